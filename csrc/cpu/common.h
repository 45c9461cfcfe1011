// Shared helpers of the CPU kernels (csrc/cpu/*.cpp): argument checks, dtype dispatch, the
// reference's dtype roundings, RMS, and a 16-lane fp32 vector type.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace dlite {

// ----------------------------------------------------------------------------- checks
inline void check_cpu_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "sglang_dlite::", op, ": ", name,
                    " must be a CPU tensor for the C++ CPU kernel, got device ", t.device(),
                    " (move it to the CPU, or use SGLANG_DLITE_OPS=auto|torch).");
  auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "sglang_dlite::", op,
                   ": ", name, " must be float32, bfloat16 or float16, got ", st, ".");
}

inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, const char* an,
                      const char* bn) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "sglang_dlite::", op, ": ", an, " (",
                   a.scalar_type(), ") and ", bn, " (", b.scalar_type(),
                   ") must have the same dtype.");
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name,
               const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, "sglang_dlite::", op, ": ", name, " must be ", layout,
                    " (", dim, " dims), got shape ", t.sizes(), ".");
}

// One tensor argument of an op: its name, rank and layout (for the messages), and whether it
// must be a float CPU tensor (a bool mask is checked for its rank only).
struct TensorArg {
  const at::Tensor& t;
  const char* name;
  int64_t dim;
  const char* layout;
  bool float_cpu = true;
};

// Every argument's device and dtype first, then every argument's rank (the order of the messages).
inline void check_args(const char* op, std::initializer_list<TensorArg> args) {
  for (const auto& a : args)
    if (a.float_cpu) check_cpu_float(a.t, op, a.name);
  for (const auto& a : args) check_dim(a.t, a.dim, op, a.name, a.layout);
}

// Every one of `others` has the dtype of `ref`.
inline void check_same_dtypes(const char* op, const TensorArg& ref, std::initializer_list<TensorArg> others) {
  for (const auto& a : others) check_same_dtype(ref.t, a.t, op, ref.name, a.name);
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
inline void dispatch_floats(at::ScalarType st, const char* op, F&& f) {
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

}  // namespace dlite
