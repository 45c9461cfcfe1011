// lm_head_argmax: final RMS-norm + the batched vocabulary projection + argmax (greedy), never
// materializing the [N, V] logits.
// Matches the torch reference of the same name in sglang_dlite/ops/reference.py.
#include "common.h"
#include "ops.h"

namespace dlite {

// ----------------------------------------------------------------------------- LM head argmax
// dots[a][m] = <w_a, y_m> for NV vocabulary rows and MB hidden rows (all of length H).
// pf (may be null): rows to prefetch into the cache meanwhile (the next tile's rows), into every
// cache level: the non-temporal hint (locality 0) made the fp32 kernel 3-7x slower than MKL's GEMV.
template <int NV, int MB>
inline void dot_tile(const float* w, int64_t ldw, const float* y, int64_t ldy, int64_t H,
                     float (&dots)[4][4], const float* pf) {
  vf16 acc[NV][MB];
  for (int a = 0; a < NV; ++a)
    for (int m = 0; m < MB; ++m) acc[a][m] = vf16{};
  const int64_t Hv = H - H % kLanes;
  for (int64_t h = 0; h < Hv; h += kLanes) {
    if (pf != nullptr)
      for (int a = 0; a < NV; ++a) __builtin_prefetch(pf + a * ldw + h, 0, 3);
    vf16 wv[NV], yv[MB];
    for (int a = 0; a < NV; ++a) wv[a] = vload(w + a * ldw + h);
    for (int m = 0; m < MB; ++m) yv[m] = vload(y + m * ldy + h);
    for (int a = 0; a < NV; ++a)
      for (int m = 0; m < MB; ++m) acc[a][m] += wv[a] * yv[m];
  }
  for (int a = 0; a < NV; ++a)
    for (int m = 0; m < MB; ++m) {
      float s = hsum(acc[a][m]);
      for (int64_t h = Hv; h < H; ++h) s += w[a * ldw + h] * y[m * ldy + h];
      dots[a][m] = s;
    }
}

template <int NV>
inline void dot_tile_m(int mb, const float* w, int64_t ldw, const float* y, int64_t ldy,
                       int64_t H, float (&dots)[4][4], const float* pf) {
  switch (mb) {
    case 4: dot_tile<NV, 4>(w, ldw, y, ldy, H, dots, pf); break;
    case 3: dot_tile<NV, 3>(w, ldw, y, ldy, H, dots, pf); break;
    case 2: dot_tile<NV, 2>(w, ldw, y, ldy, H, dots, pf); break;
    default: dot_tile<NV, 1>(w, ldw, y, ldy, H, dots, pf); break;
  }
}

// Rows up to which the streaming kernel beats ATen's GEMM (the weight read dominates).
constexpr int64_t kStreamRows = 8;

at::Tensor lm_head_argmax_cpu(const at::Tensor& hidden_, const at::Tensor& norm_weight_, double eps,
                              const at::Tensor& lm_head_weight_) {
  const char* op = "lm_head_argmax";
  check_cpu_float(hidden_, op, "hidden");
  check_cpu_float(norm_weight_, op, "norm_weight");
  check_cpu_float(lm_head_weight_, op, "lm_head_weight");
  TORCH_CHECK_VALUE(hidden_.dim() >= 1, "sglang_dlite::", op, ": hidden must be [..., H].");
  check_dim(norm_weight_, 1, op, "norm_weight", "[H]");
  check_dim(lm_head_weight_, 2, op, "lm_head_weight", "[V, H]");
  const int64_t H = hidden_.size(-1), V = lm_head_weight_.size(0);
  TORCH_CHECK_VALUE(norm_weight_.size(0) == H && lm_head_weight_.size(1) == H, "sglang_dlite::", op,
                    ": hidden [..., ", H, "], norm_weight ", norm_weight_.sizes(),
                    " and lm_head_weight ", lm_head_weight_.sizes(),
                    " disagree on the hidden size (want [H] and [V, H]).");
  TORCH_CHECK_VALUE(V >= 1, "sglang_dlite::", op, ": lm_head_weight has no rows.");
  check_same_dtype(hidden_, norm_weight_, op, "hidden", "norm_weight");
  check_same_dtype(hidden_, lm_head_weight_, op, "hidden", "lm_head_weight");
  auto x = hidden_.contiguous();
  auto nw = norm_weight_.contiguous();
  auto W = lm_head_weight_.contiguous();
  const int64_t M = x.numel() / std::max<int64_t>(H, 1);
  std::vector<int64_t> out_shape(hidden_.sizes().begin(), hidden_.sizes().end() - 1);
  auto out = at::empty(out_shape, x.options().dtype(at::kLong));
  if (M == 0) return out;

  dispatch_floats(x.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // 1. final RMS-norm of the M rows, in fp32 (rounded through T like the reference).
    std::vector<float> y(M * H);
    const T* xp = x.data_ptr<T>();
    const T* wp = nw.data_ptr<T>();
    for (int64_t m = 0; m < M; ++m) {
      const float inv = rms_inv(xp + m * H, H, eps);
      for (int64_t h = 0; h < H; ++h)
        y[m * H + h] =
            rnd<T>(static_cast<float>(xp[m * H + h]) * inv * static_cast<float>(wp[h]));
    }
    int64_t* o = out.data_ptr<int64_t>();
    if (M > kStreamRows) {
      // Compute-bound: ATen GEMMs (MKL/oneDNN) over vocabulary chunks, argmax while the chunk
      // is in cache; the [M, V] logits are never written in full.
      auto yt = at::from_blob(y.data(), {M, H}, at::TensorOptions().dtype(at::kFloat))
                    .to(x.scalar_type());
      std::vector<float> bv(M, -std::numeric_limits<float>::infinity());
      std::vector<int64_t> bi(M, 0);
      constexpr int64_t kChunk = 2048;
      for (int64_t v0 = 0; v0 < V; v0 += kChunk) {
        const int64_t nv = std::min(kChunk, V - v0);
        auto logits = at::mm(yt, W.narrow(0, v0, nv).t()).to(at::kFloat).contiguous();
        const float* lp = logits.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m) {
          const float* row = lp + m * nv;
          for (int64_t a = 0; a < nv; ++a)
            if (row[a] > bv[m]) {
              bv[m] = row[a];
              bi[m] = v0 + a;
            }
        }
      }
      for (int64_t m = 0; m < M; ++m) o[m] = bi[m];
      return;
    }
    // 2. memory-bound (few rows): stream the vocabulary once, in chunks (one per task); each
    // chunk keeps its best (logit, id) per row. ATen's GEMM is slow here (it packs the weight).
    constexpr int64_t kTile = 32;  // vocab rows per cache tile (fp32: 32 * H * 4 bytes)
    const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
    int64_t nchunks = std::min<int64_t>((V + kTile - 1) / kTile, nthreads * 4);
    const int64_t chunk = ((V + nchunks - 1) / nchunks + kTile - 1) / kTile * kTile;
    nchunks = (V + chunk - 1) / chunk;
    std::vector<float> best_v(nchunks * M, -std::numeric_limits<float>::infinity());
    std::vector<int64_t> best_i(nchunks * M, -1);
    const T* Wp = W.data_ptr<T>();
    at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
      std::vector<float> wbuf(std::is_same<T, float>::value ? 0 : kTile * H);
      for (int64_t ci = cb; ci < ce; ++ci) {
        float* bv = best_v.data() + ci * M;
        int64_t* bi = best_i.data() + ci * M;
        const int64_t v_end = std::min(V, (ci + 1) * chunk);
        for (int64_t v0 = ci * chunk; v0 < v_end; v0 += kTile) {
          const int64_t nv = std::min(kTile, v_end - v0);
          const float* wt;
          if constexpr (std::is_same<T, float>::value) {
            wt = Wp + v0 * H;
          } else {
            for (int64_t e = 0; e < nv * H; ++e) wbuf[e] = static_cast<float>(Wp[v0 * H + e]);
            wt = wbuf.data();
          }
          for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mb = static_cast<int>(std::min<int64_t>(4, M - m0));
            const float* ym = y.data() + m0 * H;
            for (int64_t a0 = 0; a0 < nv; a0 += 4) {
              float dots[4][4];
              const int na = static_cast<int>(std::min<int64_t>(4, nv - a0));
              // fp32: while the first row block runs, prefetch the same rows of the next tile
              const float* pf = (std::is_same<T, float>::value && m0 == 0 && v0 + kTile + a0 + 4 <= v_end)
                                    ? wt + (kTile + a0) * H
                                    : nullptr;
              if (na == 4) {
                dot_tile_m<4>(mb, wt + a0 * H, H, ym, H, H, dots, pf);
              } else {
                for (int a = 0; a < na; ++a) {
                  float d1[4][4];
                  dot_tile_m<1>(mb, wt + (a0 + a) * H, H, ym, H, H, d1, nullptr);
                  for (int m = 0; m < mb; ++m) dots[a][m] = d1[0][m];
                }
              }
              // Ascending vocab order + strict '>' keeps the first maximum, like torch.argmax.
              for (int a = 0; a < na; ++a)
                for (int m = 0; m < mb; ++m) {
                  const float lv = rnd<T>(dots[a][m]);
                  if (lv > bv[m0 + m]) {
                    bv[m0 + m] = lv;
                    bi[m0 + m] = v0 + a0 + a;
                  }
                }
            }
          }
        }
      }
    });
    for (int64_t m = 0; m < M; ++m) {
      float bestv = best_v[m];
      int64_t besti = best_i[m];
      for (int64_t ci = 1; ci < nchunks; ++ci) {
        if (best_v[ci * M + m] > bestv) {
          bestv = best_v[ci * M + m];
          besti = best_i[ci * M + m];
        }
      }
      o[m] = besti < 0 ? 0 : besti;  // all logits -inf/NaN: fall back to id 0
    }
  });
  return out;
}

}  // namespace dlite
