// round_attention: local-position RoPE + masked GQA attention over one round [B, S, Hq, D].
// Matches the torch reference of the same name in sglang_dlite/ops/reference.py.
#include "common.h"
#include "ops.h"

namespace dlite {

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
  const TensorArg a_q{q_, "q", 4, "[B, S, Hq, D]"}, a_k{k_, "k", 4, "[B, S, Hkv, D]"},
      a_v{v_, "v", 4, "[B, S, Hkv, D]"};
  check_args(op, {a_q, a_k, a_v, {cos_, "cos", 2, "[S, D]"}, {sin_, "sin", 2, "[S, D]"},
                  {context_valid_, "context_valid", 2, "[B, C]", false}});
  check_same_dtypes(op, a_q, {a_k, a_v});
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

}  // namespace dlite
