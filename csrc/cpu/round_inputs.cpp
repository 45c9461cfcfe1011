// assemble_round_inputs: RMS-norm of the captured hidden states + depth embeddings, anchor and
// placeholder rows, written straight into the round sequence [B, S, H].
// Matches the torch reference of the same name in sglang_dlite/ops/reference.py.
#include "common.h"
#include "ops.h"

namespace dlite {

// ----------------------------------------------------------------------------- assemble
at::Tensor assemble_round_inputs_cpu(const at::Tensor& context_hidden_, const at::Tensor& anchor_,
                                     const at::Tensor& ctx_norm_weight_,
                                     const at::Tensor& depth_embed_, const at::Tensor& mask_embed_,
                                     int64_t block_size, double eps) {
  const char* op = "assemble_round_inputs";
  const TensorArg a_ctx{context_hidden_, "context_hidden", 4, "[B, L, C, H]"},
      a_anchor{anchor_, "anchor_embeds", 2, "[B, H]"}, a_norm{ctx_norm_weight_, "ctx_norm_weight", 2, "[L, H]"},
      a_depth{depth_embed_, "depth_embed", 2, "[L+1, H]"}, a_mask{mask_embed_, "mask_embed", 1, "[H]"};
  check_args(op, {a_ctx, a_anchor, a_norm, a_depth, a_mask});
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
  check_same_dtypes(op, a_ctx, {a_anchor, a_norm, a_depth, a_mask});

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

}  // namespace dlite
