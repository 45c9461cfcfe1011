// CPU kernels of the DLite draft step, registered as torch.ops.sglang_dlite.*.
//
// Each op matches the torch reference of the same name in sglang_dlite/ops/reference.py (the spec):
//   assemble_round_inputs  RMS-norm of the captured hidden states + depth embeddings, anchor and
//                          placeholder rows, written straight into the round sequence [B, S, H]
//   round_attention        local-position RoPE + masked GQA attention over one round [B, S, Hq, D]
//   lowrank_rnn_scan       the low-rank head's gated recurrence over K positions [B, K, r]
//   lm_head_argmax         final RMS-norm + the batched vocabulary projection + argmax (greedy),
//                          never materializing the [N, V] logits
//
// Includes only <ATen/ATen.h> and <torch/library.h> (fast builds). All math is done in fp32; for
// bf16/fp16 inputs the intermediate roundings of the reference (RoPE output, normed rows, logits)
// are reproduced so results agree to the dtype's precision. Parallel over independent rows with
// at::parallel_for (OpenMP, torch's thread count).
//
// The op schemas are defined once, in csrc/schemas.cpp; this file registers the CPU
// implementations. CUDA implementations register from csrc/cuda/dlite_cuda_bindings.cpp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace dlite {
namespace {

// ----------------------------------------------------------------------------- checks
void check_cpu_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "sglang_dlite::", op, ": ", name,
                    " must be a CPU tensor for the C++ CPU kernel, got device ", t.device(),
                    " (move it to the CPU, or use SGLANG_DLITE_OPS=auto|torch).");
  auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "sglang_dlite::", op,
                   ": ", name, " must be float32, bfloat16 or float16, got ", st, ".");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, const char* an,
                      const char* bn) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "sglang_dlite::", op, ": ", an, " (",
                   a.scalar_type(), ") and ", bn, " (", b.scalar_type(),
                   ") must have the same dtype.");
}

void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name,
               const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, "sglang_dlite::", op, ": ", name, " must be ", layout,
                    " (", dim, " dims), got shape ", t.sizes(), ".");
}

template <typename T>
inline float rnd(float x) {  // round through the storage dtype, as the reference's .to(dtype) does
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float rnd<float>(float x) {
  return x;
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) with the C++ type of a float dtype (a function, not a macro, so that
// pragmas inside the kernels' lambdas are allowed).
template <typename F>
void dispatch_floats(at::ScalarType st, const char* op, F&& f) {
  switch (st) {
    case at::kFloat: f(Tag<float>{}); break;
    case at::kBFloat16: f(Tag<c10::BFloat16>{}); break;
    case at::kHalf: f(Tag<c10::Half>{}); break;
    default: TORCH_CHECK_TYPE(false, "sglang_dlite::", op, ": unsupported dtype ", st, ".");
  }
}

// 1/sqrt(mean(x^2) + eps) of one row, accumulated in fp32.
template <typename T>
inline float rms_inv(const T* x, int64_t H, double eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t h = 0; h < H; ++h) {
    float v = static_cast<float>(x[h]);
    ss += v * v;
  }
  return 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
}

// ----------------------------------------------------------------------------- assemble
at::Tensor assemble_round_inputs_cpu(const at::Tensor& context_hidden_, const at::Tensor& anchor_,
                                     const at::Tensor& ctx_norm_weight_,
                                     const at::Tensor& depth_embed_, const at::Tensor& mask_embed_,
                                     int64_t block_size, double eps) {
  const char* op = "assemble_round_inputs";
  check_cpu_float(context_hidden_, op, "context_hidden");
  check_cpu_float(anchor_, op, "anchor_embeds");
  check_cpu_float(ctx_norm_weight_, op, "ctx_norm_weight");
  check_cpu_float(depth_embed_, op, "depth_embed");
  check_cpu_float(mask_embed_, op, "mask_embed");
  check_dim(context_hidden_, 4, op, "context_hidden", "[B, L, C, H]");
  check_dim(anchor_, 2, op, "anchor_embeds", "[B, H]");
  check_dim(ctx_norm_weight_, 2, op, "ctx_norm_weight", "[L, H]");
  check_dim(depth_embed_, 2, op, "depth_embed", "[L+1, H]");
  check_dim(mask_embed_, 1, op, "mask_embed", "[H]");
  const int64_t B = context_hidden_.size(0), L = context_hidden_.size(1),
                C = context_hidden_.size(2), H = context_hidden_.size(3), K = block_size;
  TORCH_CHECK_VALUE(K >= 1, "sglang_dlite::", op, ": block_size must be >= 1, got ", K, ".");
  TORCH_CHECK_VALUE(anchor_.size(0) == B && anchor_.size(1) == H, "sglang_dlite::", op,
                    ": anchor_embeds must be [", B, ", ", H, "], got ", anchor_.sizes(), ".");
  TORCH_CHECK_VALUE(ctx_norm_weight_.size(0) == L && ctx_norm_weight_.size(1) == H,
                    "sglang_dlite::", op, ": ctx_norm_weight must be [", L, ", ", H, "], got ",
                    ctx_norm_weight_.sizes(), ".");
  TORCH_CHECK_VALUE(depth_embed_.size(0) == L + 1 && depth_embed_.size(1) == H, "sglang_dlite::",
                    op, ": depth_embed must be [", L + 1, ", ", H, "], got ", depth_embed_.sizes(),
                    ".");
  TORCH_CHECK_VALUE(mask_embed_.size(0) == H, "sglang_dlite::", op, ": mask_embed must be [", H,
                    "], got ", mask_embed_.sizes(), ".");
  check_same_dtype(context_hidden_, anchor_, op, "context_hidden", "anchor_embeds");
  check_same_dtype(context_hidden_, ctx_norm_weight_, op, "context_hidden", "ctx_norm_weight");
  check_same_dtype(context_hidden_, depth_embed_, op, "context_hidden", "depth_embed");
  check_same_dtype(context_hidden_, mask_embed_, op, "context_hidden", "mask_embed");

  auto ctx = context_hidden_.contiguous();
  auto anc = anchor_.contiguous();
  auto nw = ctx_norm_weight_.contiguous();
  auto de = depth_embed_.contiguous();
  auto me = mask_embed_.contiguous();
  const int64_t S = L * C + 1 + K;
  auto out = at::empty({B, S, H}, anc.options());

  dispatch_floats(ctx.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = ctx.data_ptr<T>();
    const T* ap = anc.data_ptr<T>();
    const T* wp = nw.data_ptr<T>();
    const T* dp = de.data_ptr<T>();
    const T* mp = me.data_ptr<T>();
    T* op_ = out.data_ptr<T>();
    const T* tok_depth = dp + L * H;
    // One placeholder row, identical for every request and every draft position.
    std::vector<T> blk(H);
    for (int64_t h = 0; h < H; ++h)
      blk[h] = static_cast<T>(static_cast<float>(mp[h]) + static_cast<float>(tok_depth[h]));
    const int64_t rows_per_b = L * C + 1;
    at::parallel_for(0, B * rows_per_b, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t b = idx / rows_per_b, r = idx % rows_per_b;
        T* dst = op_ + (b * S + r) * H;
        if (r < L * C) {  // context row (layer l, slot c): rms_norm * w_l + depth_l
          const int64_t l = r / C;
          const T* x = xp + (b * L * C + r) * H;  // [B, L, C, H] contiguous: row index r = l*C+c
          const float inv = rms_inv(x, H, eps);
          const T* w = wp + l * H;
          const T* d = dp + l * H;
          for (int64_t h = 0; h < H; ++h) {
            const float n = rnd<T>(static_cast<float>(x[h]) * inv * static_cast<float>(w[h]));
            dst[h] = static_cast<T>(n + static_cast<float>(d[h]));
          }
        } else {  // the anchor row, then this request's K placeholder rows
          const T* a = ap + b * H;
          for (int64_t h = 0; h < H; ++h)
            dst[h] = static_cast<T>(static_cast<float>(a[h]) + static_cast<float>(tok_depth[h]));
          for (int64_t i = 0; i < K; ++i) std::memcpy(dst + (1 + i) * H, blk.data(), H * sizeof(T));
        }
      }
    });
  });
  return out;
}

// 16-lane fp32 vector (GCC/Clang vector extension: AVX-512 with -mavx512f, 2x AVX2 otherwise).
typedef float vf16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline vf16 vload(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
inline float hsum(vf16 v) {
  const vf8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// ----------------------------------------------------------------------------- attention
// Row layout (reference.py): rows [0, L*C) are context rows (slot j % C), then anchor, then K
// placeholders. allowed(i, j) = i == j || (key_valid(j) && structural(i, j)).
inline bool round_allowed(int64_t i, int64_t j, int64_t n_ctx, int64_t C, const bool* valid_b,
                          bool causal) {
  if (i == j) return true;
  if (j < n_ctx && !valid_b[j % C]) return false;
  if (!causal) return true;
  if (i < n_ctx) return j < n_ctx;
  return j < n_ctx || j <= i;
}

at::Tensor round_attention_cpu(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                               const at::Tensor& cos_, const at::Tensor& sin_,
                               const at::Tensor& context_valid_, int64_t num_layers,
                               int64_t block_size, bool causal) {
  const char* op = "round_attention";
  check_cpu_float(q_, op, "q");
  check_cpu_float(k_, op, "k");
  check_cpu_float(v_, op, "v");
  check_cpu_float(cos_, op, "cos");
  check_cpu_float(sin_, op, "sin");
  check_dim(q_, 4, op, "q", "[B, S, Hq, D]");
  check_dim(k_, 4, op, "k", "[B, S, Hkv, D]");
  check_dim(v_, 4, op, "v", "[B, S, Hkv, D]");
  check_dim(cos_, 2, op, "cos", "[S, D]");
  check_dim(sin_, 2, op, "sin", "[S, D]");
  check_dim(context_valid_, 2, op, "context_valid", "[B, C]");
  check_same_dtype(q_, k_, op, "q", "k");
  check_same_dtype(q_, v_, op, "q", "v");
  TORCH_CHECK_TYPE(context_valid_.scalar_type() == at::kBool, "sglang_dlite::", op,
                   ": context_valid must be a bool tensor, got ", context_valid_.scalar_type(), ".");
  TORCH_CHECK_VALUE(context_valid_.device().is_cpu(), "sglang_dlite::", op,
                    ": context_valid must be a CPU tensor, got ", context_valid_.device(), ".");
  const int64_t B = q_.size(0), S = q_.size(1), Hq = q_.size(2), D = q_.size(3);
  const int64_t Hkv = k_.size(2);
  const int64_t C = context_valid_.size(1), L = num_layers, K = block_size;
  const int64_t n_ctx = L * C;
  TORCH_CHECK_VALUE(L >= 1 && K >= 1, "sglang_dlite::", op,
                    ": num_layers and block_size must be >= 1, got ", L, " and ", K, ".");
  TORCH_CHECK_VALUE(S == n_ctx + 1 + K, "sglang_dlite::", op, ": q has ", S,
                    " rows but a round with num_layers=", L, ", ", C, " context positions and block_size=",
                    K, " has L*C+1+K = ", n_ctx + 1 + K, " rows.");
  TORCH_CHECK_VALUE(k_.size(0) == B && k_.size(1) == S && k_.size(3) == D && v_.sizes() == k_.sizes(),
                    "sglang_dlite::", op, ": k and v must be [", B, ", ", S, ", Hkv, ", D,
                    "], got k ", k_.sizes(), " and v ", v_.sizes(), ".");
  TORCH_CHECK_VALUE(Hkv >= 1 && Hq % Hkv == 0, "sglang_dlite::", op, ": q heads (", Hq,
                    ") must be a multiple of k/v heads (", Hkv, ").");
  TORCH_CHECK_VALUE(D % 2 == 0, "sglang_dlite::", op, ": head_dim must be even, got ", D, ".");
  TORCH_CHECK_VALUE(cos_.size(0) == S && cos_.size(1) == D && sin_.sizes() == cos_.sizes(),
                    "sglang_dlite::", op, ": cos and sin must be [", S, ", ", D, "], got ",
                    cos_.sizes(), " and ", sin_.sizes(), ".");
  TORCH_CHECK_VALUE(context_valid_.size(0) == B, "sglang_dlite::", op, ": context_valid must be [",
                    B, ", C], got ", context_valid_.sizes(), ".");

  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  auto cs = cos_.to(at::kFloat).contiguous(), sn = sin_.to(at::kFloat).contiguous();
  auto valid = context_valid_.contiguous();
  auto out = at::empty({B, S, Hq, D}, q.options());
  const int64_t group = Hq / Hkv, half = D / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  dispatch_floats(q.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* qp = q.data_ptr<T>();
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    const float* cp = cs.data_ptr<float>();
    const float* sp = sn.data_ptr<float>();
    const bool* vb = valid.data_ptr<bool>();
    T* o = out.data_ptr<T>();
    // RoPE (rotate-half) of one row into dst, rounded through T like the reference's apply_rope.
    auto rope = [&](const T* x, int64_t row, float* dst) {
      const float* c = cp + row * D;
      const float* s = sp + row * D;
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
        dst[d] = rnd<T>(x1 * c[d] + (-x2) * s[d]);
        dst[d + half] = rnd<T>(x2 * c[d + half] + x1 * s[d + half]);
      }
    };
    // Keys are stored transposed ([D][Sp], fp32, Sp = S rounded up to 16 lanes, zero padded) and
    // values as [S][Dp]: the scores of one query row and its P.V are register-blocked FMAs over
    // 16 keys / 16 channels at a time.
    const int64_t Sp = (S + kLanes - 1) / kLanes * kLanes, Dp = (D + kLanes - 1) / kLanes * kLanes;
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> kt(D * Sp, 0.f), kr(D), vf(S * Dp, 0.f), qr(D), p(Sp), acc(Dp);
      std::vector<uint8_t> allowed(S * S);
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t b = idx / Hkv, g = idx % Hkv;
        const bool* valid_b = vb + b * C;
        for (int64_t i = 0; i < S; ++i)
          for (int64_t j = 0; j < S; ++j)
            allowed[i * S + j] = round_allowed(i, j, n_ctx, C, valid_b, causal);
        for (int64_t j = 0; j < S; ++j) {
          const int64_t off = ((b * S + j) * Hkv + g) * D;
          rope(kp + off, j, kr.data());
          for (int64_t d = 0; d < D; ++d) kt[d * Sp + j] = kr[d];
          for (int64_t d = 0; d < D; ++d) vf[j * Dp + d] = static_cast<float>(vp[off + d]);
        }
        for (int64_t t = 0; t < group; ++t) {
          const int64_t h = g * group + t;
          for (int64_t i = 0; i < S; ++i) {
            rope(qp + ((b * S + i) * Hq + h) * D, i, qr.data());
            float* ps = p.data();
            for (int64_t j0 = 0; j0 < Sp; j0 += kLanes) {
              vf16 a0{}, a1{};  // two chains: D is even
              const float* kc = kt.data() + j0;
              for (int64_t d = 0; d < D; d += 2) {
                a0 += qr[d] * vload(kc + d * Sp);
                a1 += qr[d + 1] * vload(kc + (d + 1) * Sp);
              }
              a0 += a1;
              std::memcpy(ps + j0, &a0, sizeof(a0));
            }
            const uint8_t* al = allowed.data() + i * S;
            float mx = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j < S; ++j) {
              ps[j] = al[j] ? ps[j] * scale : -std::numeric_limits<float>::infinity();
              mx = std::max(mx, ps[j]);
            }
            float denom = 0.f;
#pragma omp simd reduction(+ : denom)
            for (int64_t j = 0; j < S; ++j) {
              const float e = std::exp(ps[j] - mx);  // exp(-inf) = 0 for masked keys
              ps[j] = e;
              denom += e;
            }
            for (int64_t d0 = 0; d0 < Dp; d0 += kLanes) {
              vf16 a{};
              for (int64_t j = 0; j < S; ++j) a += ps[j] * vload(vf.data() + j * Dp + d0);
              std::memcpy(acc.data() + d0, &a, sizeof(a));
            }
            const float inv = 1.0f / denom;
            T* dst = o + ((b * S + i) * Hq + h) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] * inv);
          }
        }
      }
    });
  });
  return out;
}

// ----------------------------------------------------------------------------- RNN scan
at::Tensor lowrank_rnn_scan_cpu(const at::Tensor& gate_, const at::Tensor& inputs_) {
  const char* op = "lowrank_rnn_scan";
  check_cpu_float(gate_, op, "gate_logits");
  check_cpu_float(inputs_, op, "inputs");
  check_dim(gate_, 3, op, "gate_logits", "[B, K, r]");
  check_dim(inputs_, 3, op, "inputs", "[B, K, r]");
  TORCH_CHECK_VALUE(gate_.sizes() == inputs_.sizes(), "sglang_dlite::", op,
                    ": gate_logits and inputs must have the same shape [B, K, r], got ",
                    gate_.sizes(), " and ", inputs_.sizes(), ".");
  check_same_dtype(gate_, inputs_, op, "gate_logits", "inputs");
  auto g = gate_.contiguous(), u = inputs_.contiguous();
  const int64_t B = g.size(0), K = g.size(1), R = g.size(2);
  auto out = at::empty({B, K, R}, u.options());
  // Work items: (request, chunk of channels); channels are independent.
  constexpr int64_t kChunk = 64;
  const int64_t nchunk = (R + kChunk - 1) / kChunk;
  dispatch_floats(u.scalar_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* gp = g.data_ptr<T>();
    const T* up = u.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, B * nchunk, std::max<int64_t>(1, 256 / std::max<int64_t>(K, 1)),
                     [&](int64_t begin, int64_t end) {
      float s[kChunk];
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t b = idx / nchunk, c0 = (idx % nchunk) * kChunk;
        const int64_t n = std::min(kChunk, R - c0);
        for (int64_t c = 0; c < n; ++c) s[c] = 0.f;
        for (int64_t i = 0; i < K; ++i) {
          const int64_t off = (b * K + i) * R + c0;
          for (int64_t c = 0; c < n; ++c) {
            const float a = 1.0f / (1.0f + std::exp(-static_cast<float>(gp[off + c])));
            s[c] = a * s[c] + (1.0f - a) * static_cast<float>(up[off + c]);
            o[off + c] = static_cast<T>(s[c]);
          }
        }
      }
    });
  });
  return out;
}

// ----------------------------------------------------------------------------- LM head argmax
// dots[a][m] = <w_a, y_m> for NV vocabulary rows and MB hidden rows (all of length H).
// pf (may be null): rows to prefetch into the cache meanwhile (the next tile's rows).
template <int NV, int MB>
inline void dot_tile(const float* w, int64_t ldw, const float* y, int64_t ldy, int64_t H,
                     float (&dots)[4][4], const float* pf) {
  vf16 acc[NV][MB];
  for (int a = 0; a < NV; ++a)
    for (int m = 0; m < MB; ++m) acc[a][m] = vf16{};
  const int64_t Hv = H - H % kLanes;
  for (int64_t h = 0; h < Hv; h += kLanes) {
    if (pf != nullptr)
      for (int a = 0; a < NV; ++a) __builtin_prefetch(pf + a * ldw + h, 0, 0);
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

}  // namespace
}  // namespace dlite

TORCH_LIBRARY_IMPL(sglang_dlite, CPU, m) {
  m.impl("assemble_round_inputs", &dlite::assemble_round_inputs_cpu);
  m.impl("round_attention", &dlite::round_attention_cpu);
  m.impl("lowrank_rnn_scan", &dlite::lowrank_rnn_scan_cpu);
  m.impl("lm_head_argmax", &dlite::lm_head_argmax_cpu);
}
