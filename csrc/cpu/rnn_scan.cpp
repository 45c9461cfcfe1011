// lowrank_rnn_scan: the low-rank head's gated recurrence over K positions [B, K, r].
// Matches the torch reference of the same name in sglang_dlite/ops/reference.py.
#include "common.h"
#include "ops.h"

namespace dlite {

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

}  // namespace dlite
