// kv_cache_attention: causal GQA attention of a batch of variable-length query rows over a static
// KV cache (the verify / decode step of the fast regeneration engine, training/fast_regen.py).
// Matches the torch reference of the same name in sglang_dlite/ops/reference.py.
//
// Row b (slot b of the cache) has lens[b] new tokens at positions starts[b] .. starts[b]+lens[b]-1,
// already written into the cache; token t sees keys 0 .. starts[b]+t. One work item is one
// (row, KV head): its g * lens[b] queries (the g query heads of that KV head, for every token) read
// the row's keys and values once, each exactly to its own length -- no padding to a batch or chunk
// maximum, no mask tensor, and the cache past a row's last position is never read.
//
// Per work item, three passes over S = starts[b] + lens[b] keys:
//   1. scores: 16 keys at a time, the [16, D] key block transposed in registers (16x16 butterfly
//      transposes), then one broadcast FMA per (query, dimension) for 16 keys;
//   2. softmax per query over its own keys (max, exp, sum) in an L2-resident [G, S] buffer; the
//      keys a query must not see get probability 0;
//   3. P @ V: 64 keys at a time (L1-resident), 4 queries' accumulators in registers.
// Memory traffic is the K and V rows once (both prefetched during pass 1); the arithmetic (~4 FMAs per key per query) stays below
// the memory time at the GQA group sizes of decode and speculative verify (g * lens <= ~16).
// float32 only (the engine's exact path); head_dim D a multiple of 16, at most 256.
#include "common.h"
#include "ops.h"

#include <utility>

namespace dlite {
namespace {

typedef int32_t vi16 __attribute__((vector_size(64)));

// One butterfly stage of a 16x16 transpose: rows r and r|B swap their off-diagonal BxB blocks
// (lane I of the new row r: x[I] where bit B of I is clear, else y[I - B]; of row r|B: x[I + B] or y[I]).
template <int B, int... I>
inline void transpose_stage(vf16 (&m)[16], std::integer_sequence<int, I...>) {
  for (int r = 0; r < 16; ++r) {
    if (r & B) continue;
    const vf16 x = m[r], y = m[r | B];
    m[r] = __builtin_shufflevector(x, y, ((I & B) ? 16 + I - B : I)...);
    m[r | B] = __builtin_shufflevector(x, y, ((I & B) ? 16 + I : I + B)...);
  }
}

// m[r][c] -> m[c][r]
inline void transpose16(vf16 (&m)[16]) {
  constexpr auto lanes = std::make_integer_sequence<int, 16>{};
  transpose_stage<1>(m, lanes);
  transpose_stage<2>(m, lanes);
  transpose_stage<4>(m, lanes);
  transpose_stage<8>(m, lanes);
}

inline vf16 vsplat(float x) { return vf16{} + x; }

// exp(x) for x <= 0 (softmax arguments), Cephes' polynomial; ~1 ulp.
inline vf16 vexp(vf16 x) {
  const vf16 lo = vsplat(-87.3f);
  x = x < lo ? lo : x;
  const vf16 t = x * 1.44269504088896341f;
  const vf16 n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  vf16 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf16 p = vsplat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * (r * r) + r + 1.0f;
  const vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  vf16 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

inline float hmax(vf16 v) {  // the max twin of common.h's hsum
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}

constexpr int kQG = 4;    // queries per register group (scores and P @ V)
constexpr int kKB = 64;   // keys per P @ V block (V rows L1-resident across the query groups)
constexpr int64_t kPrefetchKeys = 32;

// Scratch of one worker, reused across its work items.
struct Scratch {
  std::vector<float> q, sc, acc;  // [Gp, D] scaled queries, [Gp, S16] scores / probs, [Gp, D] outputs
  std::vector<float> inv_sum;     // [Gp] 1 / softmax denominator
};

template <int D>
void attend_one(const float* Q, int64_t q_tok_stride, int64_t q_head_stride, const float* K, int64_t ks,
                const float* V, int64_t vs, float* O, int64_t start, int64_t n, int64_t g, float scale,
                Scratch& w) {
  constexpr int NV = D / 16;
  const int64_t S = start + n, S16 = (S + 15) / 16 * 16;
  const int64_t G = g * n, Gp = (G + kQG - 1) / kQG * kQG;  // query r = (token r / g, head r % g)
  w.q.assign(Gp * D, 0.f);
  w.sc.assign(Gp * S16, 0.f);
  w.acc.assign(Gp * D, 0.f);
  for (int64_t r = 0; r < G; ++r) {
    const float* src = Q + (r / g) * q_tok_stride + (r % g) * q_head_stride;
    float* dst = w.q.data() + r * D;
    for (int d = 0; d < D; ++d) dst[d] = src[d] * scale;
  }
  // 1. scores
  alignas(64) float kt[D * 16];
  for (int64_t j0 = 0; j0 < S; j0 += 16) {
    const int64_t last = std::min<int64_t>(16, S - j0) - 1;
    // software prefetch, kPrefetchKeys ahead: the K rows for this pass, the V rows for pass 3
    // (they stay in L2 until then): ~15 % faster than the hardware prefetcher alone here
    for (int jj = 0; jj < 16; ++jj) {
      const int64_t jr = std::min<int64_t>(j0 + kPrefetchKeys + jj, S - 1);
      for (int c = 0; c < D; c += 16) {
        __builtin_prefetch(K + jr * ks + c, 0, 3);
        __builtin_prefetch(V + jr * vs + c, 0, 3);
      }
    }
    for (int c = 0; c < NV; ++c) {
      vf16 m[16];
      for (int jj = 0; jj < 16; ++jj) m[jj] = vload(K + (j0 + std::min<int64_t>(jj, last)) * ks + c * 16);
      transpose16(m);
      for (int d = 0; d < 16; ++d) std::memcpy(kt + (c * 16 + d) * 16, &m[d], sizeof(vf16));
    }
    for (int64_t i0 = 0; i0 < Gp; i0 += kQG) {
      const float* qq = w.q.data() + i0 * D;
      vf16 a[kQG], b[kQG];
      for (int i = 0; i < kQG; ++i) a[i] = b[i] = vf16{};
      for (int d = 0; d < D; d += 2) {
        const vf16 k0 = vload(kt + d * 16), k1 = vload(kt + (d + 1) * 16);
        for (int i = 0; i < kQG; ++i) {
          a[i] += qq[i * D + d] * k0;
          b[i] += qq[i * D + d + 1] * k1;
        }
      }
      for (int i = 0; i < kQG; ++i) {
        const vf16 s = a[i] + b[i];
        std::memcpy(w.sc.data() + (i0 + i) * S16 + j0, &s, sizeof(vf16));
      }
    }
  }
  // 2. softmax, query r over keys 0 .. start + r / g
  const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  w.inv_sum.assign(Gp, 0.f);
  for (int64_t r = 0; r < G; ++r) {
    float* s = w.sc.data() + r * S16;
    const int32_t L = static_cast<int32_t>(start + r / g + 1);  // visible keys
    vf16 mx = vsplat(-std::numeric_limits<float>::infinity());
    for (int32_t j0 = 0; j0 < L; j0 += 16) {
      const vf16 v = vload(s + j0);
      mx = (lane + j0) < L ? (v > mx ? v : mx) : mx;
    }
    const float m = hmax(mx);
    vf16 sum = vf16{};
    for (int32_t j0 = 0; j0 < S16; j0 += 16) {
      vf16 e = vexp(vload(s + j0) - m);
      e = (lane + j0) < L ? e : vf16{};
      std::memcpy(s + j0, &e, sizeof(vf16));
      sum += e;
    }
    w.inv_sum[r] = 1.0f / hsum(sum);
  }
  // 3. P @ V
  for (int64_t j0 = 0; j0 < S; j0 += kKB) {
    const int64_t jn = std::min<int64_t>(kKB, S - j0);
    for (int64_t i0 = 0; i0 < Gp; i0 += kQG) {
      vf16 acc[kQG][NV];
      for (int i = 0; i < kQG; ++i)
        for (int c = 0; c < NV; ++c) acc[i][c] = vload(w.acc.data() + (i0 + i) * D + c * 16);
      const float* p = w.sc.data() + i0 * S16 + j0;
      for (int64_t j = 0; j < jn; ++j) {
        const float* vr = V + (j0 + j) * vs;
        vf16 vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = vload(vr + c * 16);
        for (int i = 0; i < kQG; ++i) {
          const float pi = p[i * S16 + j];
          for (int c = 0; c < NV; ++c) acc[i][c] += pi * vv[c];
        }
      }
      for (int i = 0; i < kQG; ++i)
        for (int c = 0; c < NV; ++c) std::memcpy(w.acc.data() + (i0 + i) * D + c * 16, &acc[i][c], sizeof(vf16));
    }
  }
  for (int64_t r = 0; r < G; ++r) {
    float* dst = O + (r / g) * q_tok_stride + (r % g) * q_head_stride;
    const float* a = w.acc.data() + r * D;
    for (int d = 0; d < D; ++d) dst[d] = a[d] * w.inv_sum[r];
  }
}

}  // namespace

at::Tensor kv_cache_attention_cpu(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& starts_, const at::Tensor& lens_, double scale) {
  const char* op = "kv_cache_attention";
  check_args(op, {{q_, "q", 3, "[N, Hq, D]"},
                  {k_cache, "k_cache", 4, "[slots, Hkv, L, D]"},
                  {v_cache, "v_cache", 4, "[slots, Hkv, L, D]"},
                  {starts_, "starts", 1, "[B] int64", false},
                  {lens_, "lens", 1, "[B] int64", false}});
  TORCH_CHECK_TYPE(q_.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                       v_cache.scalar_type() == at::kFloat,
                   "sglang_dlite::", op, ": the C++ kernel takes float32 q/k_cache/v_cache, got ",
                   q_.scalar_type(), "/", k_cache.scalar_type(), "/", v_cache.scalar_type(),
                   " (use SGLANG_DLITE_OPS=auto|torch for other dtypes).");
  TORCH_CHECK_TYPE(starts_.scalar_type() == at::kLong && lens_.scalar_type() == at::kLong &&
                       starts_.device().is_cpu() && lens_.device().is_cpu(),
                   "sglang_dlite::", op, ": starts and lens must be int64 CPU tensors.");
  const int64_t N = q_.size(0), Hq = q_.size(1), D = q_.size(2);
  const int64_t slots = k_cache.size(0), Hkv = k_cache.size(1), L = k_cache.size(2);
  TORCH_CHECK_VALUE(D % 16 == 0 && D >= 16 && D <= 256, "sglang_dlite::", op,
                    ": head_dim must be a multiple of 16 in [16, 256], got ", D, ".");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == D, "sglang_dlite::", op,
                    ": k_cache and v_cache must both be [slots, Hkv, L, ", D, "], got ", k_cache.sizes(),
                    " and ", v_cache.sizes(), ".");
  TORCH_CHECK_VALUE(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "sglang_dlite::", op,
                    ": the caches' last dimension must be contiguous.");
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, "sglang_dlite::", op, ": ", Hq,
                    " query heads are not a multiple of ", Hkv, " KV heads.");
  const int64_t B = starts_.size(0);
  TORCH_CHECK_VALUE(lens_.size(0) == B && B <= slots, "sglang_dlite::", op, ": starts and lens must both be [B] with B <= ",
                    slots, " slots, got ", starts_.sizes(), " and ", lens_.sizes(), ".");
  const at::Tensor starts = starts_.contiguous(), lens = lens_.contiguous();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  std::vector<int64_t> off(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(ln[b] >= 1 && st[b] >= 0 && st[b] + ln[b] <= L, "sglang_dlite::", op, ": row ", b,
                      " (start ", st[b], ", ", ln[b], " tokens) does not fit a cache of ", L, " positions.");
    off[b + 1] = off[b] + ln[b];
  }
  TORCH_CHECK_VALUE(off[B] == N, "sglang_dlite::", op, ": q has ", N, " tokens but lens sum to ", off[B], ".");
  const at::Tensor q = q_.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t g = Hq / Hkv;
  const float* Q = q.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float* Kc = k_cache.data_ptr<float>();
  const float* Vc = v_cache.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t w0, int64_t w1) {
    Scratch w;
    for (int64_t wi = w0; wi < w1; ++wi) {
      const int64_t b = wi / Hkv, h = wi % Hkv;
      const int64_t qoff = (off[b] * Hq + h * g) * D;  // token off[b], query head h*g
      const float* K = Kc + b * k_cache.stride(0) + h * k_cache.stride(1);
      const float* V = Vc + b * v_cache.stride(0) + h * v_cache.stride(1);
      const int64_t ks = k_cache.stride(2), vs = v_cache.stride(2);
#define DLITE_KV_CASE(NV)                                                                                  \
  case NV:                                                                                               \
    attend_one<NV * 16>(Q + qoff, Hq * D, D, K, ks, V, vs, O + qoff, st[b], ln[b], g, sc, w);            \
    break;
      switch (D / 16) {
        DLITE_KV_CASE(1) DLITE_KV_CASE(2) DLITE_KV_CASE(3) DLITE_KV_CASE(4) DLITE_KV_CASE(5) DLITE_KV_CASE(6)
        DLITE_KV_CASE(7) DLITE_KV_CASE(8) DLITE_KV_CASE(9) DLITE_KV_CASE(10) DLITE_KV_CASE(11) DLITE_KV_CASE(12)
        DLITE_KV_CASE(13) DLITE_KV_CASE(14) DLITE_KV_CASE(15) DLITE_KV_CASE(16)
        default: break;
      }
#undef DLITE_KV_CASE
    }
  });
  return out;
}

}  // namespace dlite
