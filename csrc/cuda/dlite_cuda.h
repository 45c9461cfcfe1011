// Plain C launchers of the DLite CUDA kernels (csrc/cuda/dlite_cuda.cu). CUDA runtime types only, so
// the .cu compiles with standalone nvcc; dlite_cuda_bindings.cpp wraps them as torch ops.
// Every launcher returns a cudaError_t (cudaSuccess = 0) as int; 'dtype' is a DliteDtype.
// All tensors are contiguous, on the current device, in the layout of ops/reference.py.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum DliteDtype { DLITE_F32 = 0, DLITE_BF16 = 1, DLITE_F16 = 2 };

// out[B, L*C+1+K, H] from context_hidden[B, L, C, H], anchor[B, H], norm_w[L, H],
// depth[L+1, H], mask[H].
int dlite_assemble_round_inputs_cuda(int dtype, const void* context_hidden, const void* anchor,
                                     const void* norm_w, const void* depth, const void* mask,
                                     void* out, int64_t B, int64_t L, int64_t C, int64_t H,
                                     int64_t K, float eps, cudaStream_t stream);

// Shared memory of round_attention: K and V of `tile` keys (fp32) + per-warp query, scores and
// output rows. The plan takes the whole round (tile = S) when it fits under smem_limit (the
// device's cudaDevAttrMaxSharedMemoryPerBlockOptin), else the largest multiple of 32 keys that
// does (online softmax across tiles); returns 0 when not even 32 keys fit. The launcher plans
// itself; callers use the plan to report or route a shape before launching.
int64_t dlite_round_attention_smem_bytes(int64_t tile, int64_t D);
int dlite_round_attention_plan(int64_t S, int64_t D, int64_t smem_limit, int64_t* tile,
                               int64_t* smem_bytes);

// out[B, S, Hq, D] from q[B, S, Hq, D], k/v[B, S, Hkv, D], cos/sin[S, D] (fp32),
// valid[B, C] (bool as bytes), S = L*C+1+K. cudaErrorInvalidConfiguration when the plan fails.
int dlite_round_attention_cuda(int dtype, const void* q, const void* k, const void* v,
                               const float* cos, const float* sin, const uint8_t* valid, void* out,
                               int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                               int64_t L, int64_t C, int causal, cudaStream_t stream);

// out[B, K, R] = the gated recurrence over gate_logits/inputs [B, K, R]. A warp owns one row
// (request or anchor) for R <= 512; a thread per channel above.
int dlite_lowrank_rnn_scan_cuda(int dtype, const void* gate_logits, const void* inputs, void* out,
                                int64_t B, int64_t K, int64_t R, cudaStream_t stream);

// out[M] = argmax over V of logits[M, V] (torch.argmax: first maximum, NaN the largest),
// logits fp32/bf16/fp16 row-major.
int dlite_rowwise_argmax_cuda(int dtype, const void* logits, int64_t* out, int64_t M, int64_t V,
                              cudaStream_t stream);

#ifdef __cplusplus
}
#endif
