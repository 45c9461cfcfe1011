// CUDA kernels of the DLite draft step (Ampere sm_80, Hopper sm_90a). CUDA headers only: the
// plain C launchers in dlite_cuda.h are wrapped as torch ops by dlite_cuda_bindings.cpp, and
// `make cuda-check` compiles this file standalone with nvcc (warnings as errors).
//
// Numerics follow ops/reference.py: fp32 math, with the reference's roundings to the storage
// dtype (RoPE output, normed rows) reproduced for bf16/fp16.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "dlite_cuda.h"

// Every launch and the dynamic shared memory go through these two macros, so that the SIMT host
// emulation (csrc/emu/, `make kernel-check`) compiles this same file with g++ and its sanitizers.
#ifndef DLITE_LAUNCH
#define DLITE_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif
#ifndef DLITE_DYNAMIC_SMEM
#define DLITE_DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#endif

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kAttentionThreads = 128;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// Round through the storage dtype, as the reference's .to(dtype) does.
template <typename T>
__device__ __forceinline__ float rnd(float x) { return to_f(from_f<T>(x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v, float* red /* >= 33 floats of shared memory */) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nwarps = blockDim.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nwarps ? red[lane] : 0.f;
    t = warp_sum(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  return red[32];
}

// ----------------------------------------------------------------------------- assemble
// One block per output row (b, r) of the round sequence.
template <typename T>
__global__ void assemble_kernel(const T* __restrict__ ctx, const T* __restrict__ anchor,
                                const T* __restrict__ norm_w, const T* __restrict__ depth,
                                const T* __restrict__ mask, T* __restrict__ out, int L, int C,
                                int H, int K, float eps) {
  __shared__ float red[33];
  const int S = L * C + 1 + K;
  const int b = blockIdx.x / S, r = blockIdx.x % S;
  T* dst = out + (static_cast<int64_t>(b) * S + r) * H;
  const T* tok_depth = depth + static_cast<int64_t>(L) * H;
  if (r < L * C) {
    const int l = r / C;
    const T* x = ctx + (static_cast<int64_t>(b) * L * C + r) * H;
    float ss = 0.f;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
      const float v = to_f(x[h]);
      ss += v * v;
    }
    ss = block_sum(ss, red);
    const float inv = rsqrtf(ss / static_cast<float>(H) + eps);
    const T* w = norm_w + static_cast<int64_t>(l) * H;
    const T* d = depth + static_cast<int64_t>(l) * H;
    for (int h = threadIdx.x; h < H; h += blockDim.x)
      dst[h] = from_f<T>(rnd<T>(to_f(x[h]) * inv * to_f(w[h])) + to_f(d[h]));
  } else if (r == L * C) {
    const T* a = anchor + static_cast<int64_t>(b) * H;
    for (int h = threadIdx.x; h < H; h += blockDim.x) dst[h] = from_f<T>(to_f(a[h]) + to_f(tok_depth[h]));
  } else {
    for (int h = threadIdx.x; h < H; h += blockDim.x) dst[h] = from_f<T>(to_f(mask[h]) + to_f(tok_depth[h]));
  }
}

// ----------------------------------------------------------------------------- attention
__device__ __forceinline__ bool round_allowed(int i, int j, int n_ctx, int C,
                                              const uint8_t* valid_b, bool causal) {
  if (i == j) return true;
  if (j < n_ctx && !valid_b[j % C]) return false;
  if (!causal) return true;
  if (i < n_ctx) return j < n_ctx;
  return j < n_ctx || j <= i;
}

// One block per (request b, query head h). The rotated keys and the values of h's KV head are
// staged in shared memory in tiles of `tile` keys (fp32, key rows padded to D+1 floats: lanes
// read different rows conflict-free); when the whole round fits (tile >= S, every shipped shape)
// they are loaded once. Each warp takes query rows, lanes over keys for the scores and over
// channels for P.V, with an online softmax across tiles (one tile: the plain softmax).
// Shared memory: dlite_round_attention_plan() in the launcher; no launch can exceed the device.
template <typename T>
__device__ void load_kv_tile(const T* __restrict__ k, const T* __restrict__ v,
                             const float* __restrict__ cos, const float* __restrict__ sin,
                             float* ks, float* vs, int b, int S, int Hkv, int g, int D, int j0, int n) {
  const int Dp = D + 1, half = D / 2;
  for (int idx = threadIdx.x; idx < n * half; idx += blockDim.x) {
    const int jj = idx / half, d = idx % half, j = j0 + jj;
    const T* kr = k + ((static_cast<int64_t>(b) * S + j) * Hkv + g) * D;
    const float x1 = to_f(kr[d]), x2 = to_f(kr[d + half]);
    const float* c = cos + static_cast<int64_t>(j) * D;
    const float* s = sin + static_cast<int64_t>(j) * D;
    ks[jj * Dp + d] = rnd<T>(x1 * c[d] - x2 * s[d]);
    ks[jj * Dp + d + half] = rnd<T>(x2 * c[d + half] + x1 * s[d + half]);
  }
  for (int idx = threadIdx.x; idx < n * D; idx += blockDim.x) {
    const int jj = idx / D, d = idx % D;
    vs[idx] = to_f(v[((static_cast<int64_t>(b) * S + j0 + jj) * Hkv + g) * D + d]);
  }
}

template <typename T>
__global__ void round_attention_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, const float* __restrict__ cos,
                                       const float* __restrict__ sin,
                                       const uint8_t* __restrict__ valid, T* __restrict__ out,
                                       int S, int Hq, int Hkv, int D, int C, int n_ctx,
                                       bool causal, int tile) {
  DLITE_DYNAMIC_SMEM(float, smem);
  const int nwarps = blockDim.x / kWarp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int Dp = D + 1, half = D / 2;
  float* ks = smem;               // [tile][D+1]
  float* vs = ks + tile * Dp;     // [tile][D]
  float* qs = vs + tile * D;      // [nwarps][D]   rotated query of the warp's row
  float* ps = qs + nwarps * D;    // [nwarps][tile] scores, then probabilities
  float* os = ps + nwarps * tile; // [nwarps][D]   the row's unnormalised output
  const int b = blockIdx.x / Hq, h = blockIdx.x % Hq;
  const int g = h / (Hq / Hkv);
  const uint8_t* valid_b = valid + static_cast<int64_t>(b) * C;
  const float scale = rsqrtf(static_cast<float>(D));
  const bool one_tile = tile >= S;
  if (one_tile) {
    load_kv_tile<T>(k, v, cos, sin, ks, vs, b, S, Hkv, g, D, 0, S);
    __syncthreads();
  }

  float* qw = qs + warp * D;
  float* pw = ps + warp * tile;
  float* ow = os + warp * D;
  // Every warp walks every step (rows past S idle): the tile loads below are block-wide.
  for (int i0 = 0; i0 < S; i0 += nwarps) {
    const int i = i0 + warp;
    const bool active = i < S;  // uniform within the warp
    if (active) {
      const T* qr = q + ((static_cast<int64_t>(b) * S + i) * Hq + h) * D;
      const float* c = cos + static_cast<int64_t>(i) * D;
      const float* s = sin + static_cast<int64_t>(i) * D;
      for (int d = lane; d < half; d += kWarp) {
        const float x1 = to_f(qr[d]), x2 = to_f(qr[d + half]);
        qw[d] = rnd<T>(x1 * c[d] - x2 * s[d]);
        qw[d + half] = rnd<T>(x2 * c[d + half] + x1 * s[d + half]);
      }
      for (int d = lane; d < D; d += kWarp) ow[d] = 0.f;
      __syncwarp();
    }
    float m = -INFINITY, l = 0.f;
    for (int j0 = 0; j0 < S; j0 += tile) {
      const int n = S - j0 < tile ? S - j0 : tile;
      if (!one_tile) {
        __syncthreads();  // every warp is done with the previous tile
        load_kv_tile<T>(k, v, cos, sin, ks, vs, b, S, Hkv, g, D, j0, n);
        __syncthreads();
      }
      if (!active) continue;
      float mx = -INFINITY;
      for (int jj = lane; jj < n; jj += kWarp) {
        const int j = j0 + jj;
        float sc = -INFINITY;
        if (round_allowed(i, j, n_ctx, C, valid_b, causal)) {
          const float* kj = ks + jj * Dp;
          float dot = 0.f;
          for (int d = 0; d < D; ++d) dot += qw[d] * kj[d];
          sc = dot * scale;
        }
        pw[jj] = sc;
        mx = fmaxf(mx, sc);
      }
      mx = warp_max(mx);
      const float m_new = fmaxf(m, mx);
      if (m_new == -INFINITY) continue;  // nothing visible yet (uniform within the warp)
      const float corr = m == -INFINITY ? 0.f : expf(m - m_new);
      float sum = 0.f;
      for (int jj = lane; jj < n; jj += kWarp) {
        const float e = pw[jj] == -INFINITY ? 0.f : expf(pw[jj] - m_new);
        pw[jj] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      __syncwarp();
      l = l * corr + sum;
      m = m_new;
      for (int d = lane; d < D; d += kWarp) {
        float acc = ow[d] * corr;
        for (int jj = 0; jj < n; ++jj) acc += pw[jj] * vs[jj * D + d];
        ow[d] = acc;
      }
      __syncwarp();  // pw is rewritten by the next tile
    }
    if (active) {
      const float inv = 1.f / l;  // l > 0: every row attends to itself
      T* dst = out + ((static_cast<int64_t>(b) * S + i) * Hq + h) * D;
      for (int d = lane; d < D; d += kWarp) dst[d] = from_f<T>(ow[d] * inv);
      __syncwarp();  // qw / ow are rewritten by this warp's next row
    }
  }
}

// ----------------------------------------------------------------------------- RNN scan
// A warp owns one row (a request, or an anchor in training) and walks the K steps; lane l holds
// channels l, l+32, ... (CPL of them) in registers, so loads and stores are coalesced and the
// state never leaves the register file. Loads of a step do not depend on the state.
template <typename T, int CPL>
__global__ void __launch_bounds__(128) scan_warp_kernel(const T* __restrict__ g,
                                                        const T* __restrict__ u,
                                                        T* __restrict__ out, int B, int K, int R) {
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= B) return;  // whole warps exit together
  float s[CPL];
#pragma unroll
  for (int c = 0; c < CPL; ++c) s[c] = 0.f;
  const int64_t base = static_cast<int64_t>(row) * K * R;
  for (int i = 0; i < K; ++i) {
    const int64_t off = base + static_cast<int64_t>(i) * R;
    float gv[CPL], uv[CPL];
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int ch = lane + c * kWarp;
      gv[c] = ch < R ? to_f(g[off + ch]) : 0.f;
      uv[c] = ch < R ? to_f(u[off + ch]) : 0.f;
    }
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int ch = lane + c * kWarp;
      const float a = 1.f / (1.f + expf(-gv[c]));
      s[c] = a * s[c] + (1.f - a) * uv[c];
      if (ch < R) out[off + ch] = from_f<T>(s[c]);
    }
  }
}

// Ranks above 512: one thread per (row, channel).
template <typename T>
__global__ void scan_thread_kernel(const T* __restrict__ g, const T* __restrict__ u,
                                   T* __restrict__ out, int64_t B, int K, int R) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= B * R) return;
  const int64_t row = t / R, ch = t % R;
  float s = 0.f;
  for (int i = 0; i < K; ++i) {
    const int64_t off = (row * K + i) * R + ch;
    const float a = 1.f / (1.f + expf(-to_f(g[off])));
    s = a * s + (1.f - a) * to_f(u[off]);
    out[off] = from_f<T>(s);
  }
}

// ----------------------------------------------------------------------------- argmax
// One block per row; the first maximum (lowest id on ties, NaN counts as the maximum), like
// torch.argmax.
template <typename T>
__global__ void rowwise_argmax_kernel(const T* __restrict__ logits, int64_t* __restrict__ out,
                                      int64_t V) {
  __shared__ float bv[32];
  __shared__ int64_t bi[32];
  const T* row = logits + static_cast<int64_t>(blockIdx.x) * V;
  float best = -INFINITY;
  int64_t idx = V;  // "none yet": larger than any id
  // torch.argmax's order: NaN above everything, then the value, then the lower id.
  auto better = [](float a, int64_t ia, float b, int64_t ib) {
    const bool an = isnan(a), bn = isnan(b);
    if (an != bn) return an;
    if (!an && a != b) return a > b;
    return ia < ib;
  };
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float x = to_f(row[v]);
    if (better(x, v, best, idx)) {
      best = x;
      idx = v;
    }
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(kFull, best, o);
    const int64_t oi = __shfl_xor_sync(kFull, idx, o);
    if (better(ob, oi, best, idx)) {
      best = ob;
      idx = oi;
    }
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) {
    bv[warp] = best;
    bi[warp] = idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / kWarp); ++w)
      if (better(bv[w], bi[w], best, idx)) {
        best = bv[w];
        idx = bi[w];
      }
    out[blockIdx.x] = idx < V ? idx : 0;  // V == 0: id 0
  }
}

template <template <typename> class F, typename... Args>
int dispatch(int dtype, Args... args) {
  switch (dtype) {
    case DLITE_F32: return F<float>::run(args...);
    case DLITE_BF16: return F<__nv_bfloat16>::run(args...);
    case DLITE_F16: return F<__half>::run(args...);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

template <typename T>
struct AssembleLaunch {
  static int run(const void* ctx, const void* anchor, const void* norm_w, const void* depth,
                 const void* mask, void* out, int64_t B, int64_t L, int64_t C, int64_t H,
                 int64_t K, float eps, cudaStream_t stream) {
    const int64_t rows = B * (L * C + 1 + K);
    if (rows == 0 || H == 0) return static_cast<int>(cudaSuccess);
    const int threads = H >= 1024 ? 256 : 128;
    DLITE_LAUNCH(assemble_kernel<T>, static_cast<unsigned>(rows), threads, 0, stream)(
        static_cast<const T*>(ctx), static_cast<const T*>(anchor), static_cast<const T*>(norm_w),
        static_cast<const T*>(depth), static_cast<const T*>(mask), static_cast<T*>(out),
        static_cast<int>(L), static_cast<int>(C), static_cast<int>(H), static_cast<int>(K), eps);
    return static_cast<int>(cudaGetLastError());
  }
};

template <typename T>
struct AttentionLaunch {
  static int run(const void* q, const void* k, const void* v, const float* cos, const float* sin,
                 const uint8_t* valid, void* out, int64_t B, int64_t S, int64_t Hq, int64_t Hkv,
                 int64_t D, int64_t L, int64_t C, int causal, cudaStream_t stream) {
    if (B == 0) return static_cast<int>(cudaSuccess);
    int dev = 0, limit = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) {
      cudaGetLastError();  // leave no error behind for the next, unrelated CUDA call
      return static_cast<int>(e);
    }
    int64_t tile = 0, smem = 0;
    if (!dlite_round_attention_plan(S, D, limit, &tile, &smem))
      return static_cast<int>(cudaErrorInvalidConfiguration);
    if (smem > 48 * 1024) {
      e = cudaFuncSetAttribute(round_attention_kernel<T>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
      if (e != cudaSuccess) {
        cudaGetLastError();
        return static_cast<int>(e);
      }
    }
    DLITE_LAUNCH(round_attention_kernel<T>, static_cast<unsigned>(B * Hq), kAttentionThreads,
                 static_cast<size_t>(smem), stream)(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), cos, sin,
        valid, static_cast<T*>(out), static_cast<int>(S), static_cast<int>(Hq),
        static_cast<int>(Hkv), static_cast<int>(D), static_cast<int>(C),
        static_cast<int>(L * C), causal != 0, static_cast<int>(tile));
    return static_cast<int>(cudaGetLastError());
  }
};

template <typename T>
struct ScanLaunch {
  template <int CPL>
  static void warp(const T* g, const T* u, T* out, int64_t B, int64_t K, int64_t R,
                   cudaStream_t stream) {
    const int threads = 128, rows_per_block = threads / kWarp;
    const unsigned blocks = static_cast<unsigned>((B + rows_per_block - 1) / rows_per_block);
    auto* kernel = &scan_warp_kernel<T, CPL>;
    DLITE_LAUNCH(kernel, blocks, threads, 0, stream)(g, u, out, static_cast<int>(B),
                                                             static_cast<int>(K), static_cast<int>(R));
  }
  static int run(const void* gate, const void* inputs, void* out_, int64_t B, int64_t K,
                 int64_t R, cudaStream_t stream) {
    if (B == 0 || K == 0 || R == 0) return static_cast<int>(cudaSuccess);
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(inputs);
    T* out = static_cast<T*>(out_);
    const int64_t cpl = (R + kWarp - 1) / kWarp;
    if (cpl <= 1) warp<1>(g, u, out, B, K, R, stream);
    else if (cpl <= 2) warp<2>(g, u, out, B, K, R, stream);
    else if (cpl <= 4) warp<4>(g, u, out, B, K, R, stream);
    else if (cpl <= 8) warp<8>(g, u, out, B, K, R, stream);
    else if (cpl <= 16) warp<16>(g, u, out, B, K, R, stream);
    else {
      const int threads = 256;
      const unsigned blocks = static_cast<unsigned>((B * R + threads - 1) / threads);
      DLITE_LAUNCH(scan_thread_kernel<T>, blocks, threads, 0, stream)(g, u, out, B, static_cast<int>(K),
                                                            static_cast<int>(R));
    }
    return static_cast<int>(cudaGetLastError());
  }
};

template <typename T>
struct ArgmaxLaunch {
  static int run(const void* logits, int64_t* out, int64_t M, int64_t V, cudaStream_t stream) {
    if (M == 0) return static_cast<int>(cudaSuccess);
    DLITE_LAUNCH(rowwise_argmax_kernel<T>, static_cast<unsigned>(M), 256, 0, stream)(
        static_cast<const T*>(logits), out, V);
    return static_cast<int>(cudaGetLastError());
  }
};

}  // namespace

extern "C" {

int64_t dlite_round_attention_smem_bytes(int64_t tile, int64_t D) {
  const int64_t nwarps = kAttentionThreads / kWarp;
  return static_cast<int64_t>(sizeof(float)) * (tile * (D + 1) + tile * D + nwarps * (2 * D + tile));
}

int dlite_round_attention_plan(int64_t S, int64_t D, int64_t smem_limit, int64_t* tile,
                               int64_t* smem_bytes) {
  int64_t t = S;
  if (dlite_round_attention_smem_bytes(t, D) > smem_limit) {
    // the largest multiple of 32 keys (a key per lane) that fits
    const int64_t per_key = static_cast<int64_t>(sizeof(float)) * (2 * D + 1 + kAttentionThreads / kWarp);
    const int64_t fixed = dlite_round_attention_smem_bytes(0, D);
    t = smem_limit > fixed ? (smem_limit - fixed) / per_key / kWarp * kWarp : 0;
    if (t > S) t = S;
  }
  *tile = t;
  *smem_bytes = dlite_round_attention_smem_bytes(t, D);
  return t >= 1 && (t == S || t >= kWarp) && *smem_bytes <= smem_limit;
}

int dlite_assemble_round_inputs_cuda(int dtype, const void* context_hidden, const void* anchor,
                                     const void* norm_w, const void* depth, const void* mask,
                                     void* out, int64_t B, int64_t L, int64_t C, int64_t H,
                                     int64_t K, float eps, cudaStream_t stream) {
  return dispatch<AssembleLaunch>(dtype, context_hidden, anchor, norm_w, depth, mask, out, B, L, C,
                                  H, K, eps, stream);
}

int dlite_round_attention_cuda(int dtype, const void* q, const void* k, const void* v,
                               const float* cos, const float* sin, const uint8_t* valid, void* out,
                               int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                               int64_t L, int64_t C, int causal, cudaStream_t stream) {
  return dispatch<AttentionLaunch>(dtype, q, k, v, cos, sin, valid, out, B, S, Hq, Hkv, D, L, C,
                                   causal, stream);
}

int dlite_lowrank_rnn_scan_cuda(int dtype, const void* gate_logits, const void* inputs, void* out,
                                int64_t B, int64_t K, int64_t R, cudaStream_t stream) {
  return dispatch<ScanLaunch>(dtype, gate_logits, inputs, out, B, K, R, stream);
}

int dlite_rowwise_argmax_cuda(int dtype, const void* logits, int64_t* out, int64_t M, int64_t V,
                              cudaStream_t stream) {
  return dispatch<ArgmaxLaunch>(dtype, logits, out, M, V, stream);
}

}  // extern "C"
