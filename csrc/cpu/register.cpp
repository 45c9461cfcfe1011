// CPU kernels of the DLite draft step and of the fast regeneration engine, registered as torch.ops.sglang_dlite.* (one file each).
//
// Each op matches the torch reference of the same name in sglang_dlite/ops/reference.py (the spec):
//   assemble_round_inputs  RMS-norm of the captured hidden states + depth embeddings, anchor and
//                          placeholder rows, written straight into the round sequence [B, S, H]
//   round_attention        local-position RoPE + masked GQA attention over one round [B, S, Hq, D]
//   lowrank_rnn_scan       the low-rank head's gated recurrence over K positions [B, K, r]
//   lm_head_argmax         final RMS-norm + the batched vocabulary projection + argmax (greedy),
//                          never materializing the [N, V] logits
//   kv_cache_attention     causal GQA attention of variable-length query rows over a static KV
//                          cache (the fast regeneration engine's decode / verify step; float32)
//
// Includes only <ATen/ATen.h> and <torch/library.h> (fast builds). All math is done in fp32; for
// bf16/fp16 inputs the intermediate roundings of the reference (RoPE output, normed rows, logits)
// are reproduced so results agree to the dtype's precision. Parallel over independent rows with
// at::parallel_for (OpenMP, torch's thread count).
//
// The op schemas are defined once, in csrc/schemas.cpp; this file registers the CPU
// implementations (kernels in round_inputs.cpp, round_attention.cpp, rnn_scan.cpp,
// lm_head_argmax.cpp,
// kv_cache_attention.cpp; shared helpers in common.h). CUDA implementations register from
// csrc/cuda/dlite_cuda_bindings.cpp.

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY_IMPL(sglang_dlite, CPU, m) {
  m.impl("assemble_round_inputs", &dlite::assemble_round_inputs_cpu);
  m.impl("round_attention", &dlite::round_attention_cpu);
  m.impl("lowrank_rnn_scan", &dlite::lowrank_rnn_scan_cpu);
  m.impl("lm_head_argmax", &dlite::lm_head_argmax_cpu);
  m.impl("kv_cache_attention", &dlite::kv_cache_attention_cpu);
}
