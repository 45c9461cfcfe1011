// The one place where torch.ops.sglang_dlite.* are declared (schemas only).
//
//   csrc/cpu/*.cpp                     CPU implementations, one kernel per file (registered in
//                                      csrc/cpu/register.cpp: TORCH_LIBRARY_IMPL ..., CPU)
//   csrc/cuda/dlite_cuda_bindings.cpp  CUDA implementations  (TORCH_LIBRARY_IMPL ..., CUDA)
//   sglang_dlite/ops/fake.py           fake (meta) kernels: output shapes/dtypes for torch.compile
//                                      and FakeTensor tracing (torch imports it on demand through
//                                      set_python_module below)
//   sglang_dlite/ops/reference.py      the torch reference of each op: the spec every kernel is
//                                      tested against
#include <torch/library.h>

TORCH_LIBRARY(sglang_dlite, m) {
  m.set_python_module("sglang_dlite.ops.fake");
  m.def(
      "assemble_round_inputs(Tensor context_hidden, Tensor anchor_embeds, Tensor ctx_norm_weight, "
      "Tensor depth_embed, Tensor mask_embed, int block_size, float eps) -> Tensor");
  m.def(
      "round_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor context_valid, "
      "int num_layers, int block_size, bool causal) -> Tensor");
  m.def("lowrank_rnn_scan(Tensor gate_logits, Tensor inputs) -> Tensor");
  m.def("lm_head_argmax(Tensor hidden, Tensor norm_weight, float eps, Tensor lm_head_weight) -> Tensor");
  m.def(
      "kv_cache_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor starts, Tensor lens, "
      "float scale) -> Tensor");
}
