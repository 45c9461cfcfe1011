// The CPU implementations of the torch.ops.sglang_dlite.* ops (schemas: csrc/schemas.cpp),
// one kernel per file in csrc/cpu/, registered in csrc/cpu/register.cpp.
#pragma once

#include <ATen/ATen.h>

namespace dlite {
at::Tensor assemble_round_inputs_cpu(const at::Tensor& context_hidden_, const at::Tensor& anchor_,
                                     const at::Tensor& ctx_norm_weight_,
                                     const at::Tensor& depth_embed_, const at::Tensor& mask_embed_,
                                     int64_t block_size, double eps);
at::Tensor round_attention_cpu(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                               const at::Tensor& cos_, const at::Tensor& sin_,
                               const at::Tensor& context_valid_, int64_t num_layers,
                               int64_t block_size, bool causal);
at::Tensor lowrank_rnn_scan_cpu(const at::Tensor& gate_, const at::Tensor& inputs_);
at::Tensor lm_head_argmax_cpu(const at::Tensor& hidden_, const at::Tensor& norm_weight_, double eps,
                              const at::Tensor& lm_head_weight_);
at::Tensor kv_cache_attention_cpu(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& starts_, const at::Tensor& lens_, double scale);

}  // namespace dlite
