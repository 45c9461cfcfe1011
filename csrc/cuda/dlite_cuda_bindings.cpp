// Registers the CUDA implementations of torch.ops.sglang_dlite.* (schemas are defined in
// csrc/schemas.cpp). Built only with a CUDA torch (sglang_dlite/ops/build.py adds this file and
// -DDLITE_WITH_CUDA). Checks inputs, makes them contiguous and calls the plain C launchers of
// dlite_cuda.cu on the current stream.
#ifdef DLITE_WITH_CUDA

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <initializer_list>
#include <utility>

#include "dlite_cuda.h"

namespace dlite_cuda {
namespace {

int dtype_code(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DLITE_F32;
    case at::kBFloat16: return DLITE_BF16;
    case at::kHalf: return DLITE_F16;
    default:
      TORCH_CHECK_TYPE(false, "sglang_dlite::", op, ": ", name,
                       " must be float32, bfloat16 or float16, got ", t.scalar_type(), ".");
  }
  return -1;
}

void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == ref.device(), "sglang_dlite::", op, ": ", name,
                    " must be a CUDA tensor on ", ref.device(), ", got ", t.device(), ".");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* op, const char* an,
                const char* bn) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "sglang_dlite::", op, ": ", an, " (",
                   a.scalar_type(), ") and ", bn, " (", b.scalar_type(),
                   ") must have the same dtype.");
}

using Named = std::pair<const at::Tensor*, const char*>;

// Every input on ref's CUDA device; `same_dtype` ones also in ref's dtype.
void check_inputs(const at::Tensor& ref, const char* op, const char* ref_name,
                  std::initializer_list<Named> same_dtype, std::initializer_list<Named> device_only = {}) {
  for (const Named& t : same_dtype) {
    check_cuda(*t.first, ref, op, t.second);
    check_same(ref, *t.first, op, ref_name, t.second);
  }
  for (const Named& t : device_only) check_cuda(*t.first, ref, op, t.second);
}

// The launchers clear the CUDA error they return (cudaGetLastError), so a failed launch leaves
// nothing behind for the next, unrelated CUDA call.
void check_launch(int err, const char* op) {
  TORCH_CHECK(err == 0, "sglang_dlite::", op, ": CUDA launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// The launcher plans its own shared memory and answers cudaErrorInvalidConfiguration when not even
// 32 keys of the round fit the device; this turns that answer into an error naming the shape and
// the limit (asked only then: the draft round's launches query nothing).
void check_attention_plan(int64_t S, int64_t D, const char* op) {
  int dev = 0, smem_limit = 0;
  check_launch(static_cast<int>(cudaGetDevice(&dev)), op);
  check_launch(static_cast<int>(cudaDeviceGetAttribute(
                   &smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)),
               op);
  int64_t tile = 0, smem = 0;
  TORCH_CHECK_VALUE(dlite_round_attention_plan(S, D, smem_limit, &tile, &smem), "sglang_dlite::", op,
                    ": a round of S=", S, " rows with head_dim D=", D, " needs ",
                    dlite_round_attention_smem_bytes(S < 32 ? S : 32, D),
                    " B of shared memory per block even in 32-key tiles; this GPU allows ",
                    smem_limit, " B (use SGLANG_DLITE_OPS=auto or torch).");
}

at::Tensor assemble_round_inputs_cuda(const at::Tensor& ctx_, const at::Tensor& anchor_,
                                      const at::Tensor& norm_w_, const at::Tensor& depth_,
                                      const at::Tensor& mask_, int64_t K, double eps) {
  const char* op = "assemble_round_inputs";
  TORCH_CHECK_VALUE(ctx_.dim() == 4 && anchor_.dim() == 2 && norm_w_.dim() == 2 &&
                        depth_.dim() == 2 && mask_.dim() == 1,
                    "sglang_dlite::", op,
                    ": want context_hidden [B, L, C, H], anchor_embeds [B, H], ctx_norm_weight "
                    "[L, H], depth_embed [L+1, H], mask_embed [H].");
  const int64_t B = ctx_.size(0), L = ctx_.size(1), C = ctx_.size(2), H = ctx_.size(3);
  TORCH_CHECK_VALUE(K >= 1, "sglang_dlite::", op, ": block_size must be >= 1, got ", K, ".");
  TORCH_CHECK_VALUE(anchor_.size(0) == B && anchor_.size(1) == H && norm_w_.size(0) == L &&
                        norm_w_.size(1) == H && depth_.size(0) == L + 1 && depth_.size(1) == H &&
                        mask_.size(0) == H,
                    "sglang_dlite::", op, ": shapes disagree: context_hidden ", ctx_.sizes(),
                    ", anchor_embeds ", anchor_.sizes(), ", ctx_norm_weight ", norm_w_.sizes(),
                    ", depth_embed ", depth_.sizes(), ", mask_embed ", mask_.sizes(), ".");
  check_inputs(ctx_, op, "context_hidden",
               {{&anchor_, "anchor_embeds"}, {&norm_w_, "ctx_norm_weight"}, {&depth_, "depth_embed"},
                {&mask_, "mask_embed"}});
  const int dt = dtype_code(ctx_, op, "context_hidden");
  const c10::cuda::CUDAGuard guard(ctx_.device());
  auto ctx = ctx_.contiguous(), anchor = anchor_.contiguous(), nw = norm_w_.contiguous(),
       depth = depth_.contiguous(), mask = mask_.contiguous();
  auto out = at::empty({B, L * C + 1 + K, H}, anchor.options());
  check_launch(dlite_assemble_round_inputs_cuda(
                   dt, ctx.data_ptr(), anchor.data_ptr(), nw.data_ptr(), depth.data_ptr(),
                   mask.data_ptr(), out.data_ptr(), B, L, C, H, K, static_cast<float>(eps),
                   c10::cuda::getCurrentCUDAStream().stream()),
               op);
  return out;
}

at::Tensor round_attention_cuda(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                const at::Tensor& cos_, const at::Tensor& sin_,
                                const at::Tensor& valid_, int64_t L, int64_t K, bool causal) {
  const char* op = "round_attention";
  TORCH_CHECK_VALUE(q_.dim() == 4 && k_.dim() == 4 && v_.dim() == 4 && cos_.dim() == 2 &&
                        sin_.dim() == 2 && valid_.dim() == 2,
                    "sglang_dlite::", op,
                    ": want q [B, S, Hq, D], k/v [B, S, Hkv, D], cos/sin [S, D], context_valid [B, C].");
  const int64_t B = q_.size(0), S = q_.size(1), Hq = q_.size(2), D = q_.size(3), Hkv = k_.size(2);
  const int64_t C = valid_.size(1);
  TORCH_CHECK_VALUE(L >= 1 && K >= 1 && S == L * C + 1 + K, "sglang_dlite::", op, ": q has ", S,
                    " rows but a round with num_layers=", L, ", ", C,
                    " context positions and block_size=", K, " has L*C+1+K = ", L * C + 1 + K,
                    " rows.");
  TORCH_CHECK_VALUE(k_.size(0) == B && k_.size(1) == S && k_.size(3) == D && v_.sizes() == k_.sizes() &&
                        Hkv >= 1 && Hq % Hkv == 0 && D % 2 == 0 && cos_.size(0) == S &&
                        cos_.size(1) == D && sin_.sizes() == cos_.sizes() && valid_.size(0) == B,
                    "sglang_dlite::", op, ": shapes disagree: q ", q_.sizes(), ", k ", k_.sizes(),
                    ", v ", v_.sizes(), ", cos ", cos_.sizes(), ", context_valid ", valid_.sizes(),
                    " (Hq must be a multiple of Hkv, D even).");
  TORCH_CHECK_TYPE(valid_.scalar_type() == at::kBool, "sglang_dlite::", op,
                   ": context_valid must be a bool tensor, got ", valid_.scalar_type(), ".");
  check_inputs(q_, op, "q", {{&k_, "k"}, {&v_, "v"}},
               {{&cos_, "cos"}, {&sin_, "sin"}, {&valid_, "context_valid"}});
  const int dt = dtype_code(q_, op, "q");
  const c10::cuda::CUDAGuard guard(q_.device());
  auto q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  auto cs = cos_.to(at::kFloat).contiguous(), sn = sin_.to(at::kFloat).contiguous();
  auto valid = valid_.contiguous();
  auto out = at::empty({B, S, Hq, D}, q.options());
  const int err = dlite_round_attention_cuda(dt, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                             cs.data_ptr<float>(), sn.data_ptr<float>(),
                                             reinterpret_cast<const uint8_t*>(valid.data_ptr<bool>()),
                                             out.data_ptr(), B, S, Hq, Hkv, D, L, C, causal ? 1 : 0,
                                             c10::cuda::getCurrentCUDAStream().stream());
  if (err == cudaErrorInvalidConfiguration) check_attention_plan(S, D, op);  // say why, if it is the plan
  check_launch(err, op);
  return out;
}

at::Tensor lowrank_rnn_scan_cuda(const at::Tensor& g_, const at::Tensor& u_) {
  const char* op = "lowrank_rnn_scan";
  TORCH_CHECK_VALUE(g_.dim() == 3 && g_.sizes() == u_.sizes(), "sglang_dlite::", op,
                    ": gate_logits and inputs must have the same shape [B, K, r], got ",
                    g_.sizes(), " and ", u_.sizes(), ".");
  check_inputs(g_, op, "gate_logits", {{&u_, "inputs"}});
  const int dt = dtype_code(g_, op, "gate_logits");
  const c10::cuda::CUDAGuard guard(g_.device());
  auto g = g_.contiguous(), u = u_.contiguous();
  auto out = at::empty_like(u);
  check_launch(dlite_lowrank_rnn_scan_cuda(dt, g.data_ptr(), u.data_ptr(), out.data_ptr(),
                                           g.size(0), g.size(1), g.size(2),
                                           c10::cuda::getCurrentCUDAStream().stream()),
               op);
  return out;
}

// Final RMS-norm (ATen, fp32 math like the reference) + the vocabulary projection as one cuBLAS
// GEMM + a row-wise argmax kernel reading the logits in their dtype (no fp32 copy of [M, V]).
at::Tensor lm_head_argmax_cuda(const at::Tensor& hidden, const at::Tensor& norm_w, double eps,
                               const at::Tensor& W) {
  const char* op = "lm_head_argmax";
  TORCH_CHECK_VALUE(hidden.dim() >= 1 && norm_w.dim() == 1 && W.dim() == 2 &&
                        norm_w.size(0) == hidden.size(-1) && W.size(1) == hidden.size(-1),
                    "sglang_dlite::", op, ": hidden ", hidden.sizes(), ", norm_weight ",
                    norm_w.sizes(), " and lm_head_weight ", W.sizes(),
                    " disagree on the hidden size (want [..., H], [H] and [V, H]).");
  check_inputs(hidden, op, "hidden", {{&norm_w, "norm_weight"}, {&W, "lm_head_weight"}});
  const int dt = dtype_code(hidden, op, "hidden");
  const c10::cuda::CUDAGuard guard(hidden.device());
  const int64_t H = hidden.size(-1), V = W.size(0);
  auto x = hidden.reshape({-1, H}).to(at::kFloat);
  x = x * at::rsqrt(x.pow(2).mean(-1, true) + eps);
  auto y = (x * norm_w.to(at::kFloat)).to(hidden.scalar_type());
  auto logits = at::mm(y, W.t()).contiguous();  // cuBLAS
  std::vector<int64_t> shape(hidden.sizes().begin(), hidden.sizes().end() - 1);
  auto out = at::empty(shape, hidden.options().dtype(at::kLong));
  check_launch(dlite_rowwise_argmax_cuda(dt, logits.data_ptr(), out.data_ptr<int64_t>(),
                                         logits.size(0), V,
                                         c10::cuda::getCurrentCUDAStream().stream()),
               op);
  return out;
}

}  // namespace
}  // namespace dlite_cuda

TORCH_LIBRARY_IMPL(sglang_dlite, CUDA, m) {
  m.impl("assemble_round_inputs", &dlite_cuda::assemble_round_inputs_cuda);
  m.impl("round_attention", &dlite_cuda::round_attention_cuda);
  m.impl("lowrank_rnn_scan", &dlite_cuda::lowrank_rnn_scan_cuda);
  m.impl("lm_head_argmax", &dlite_cuda::lm_head_argmax_cuda);
}

#endif  // DLITE_WITH_CUDA
