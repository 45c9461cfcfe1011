// The emulated kernel library's C API (ctypes) and, with -DDLITE_EMU_DRIVER, a driver program for
// the sanitizer builds (a Python process cannot load a TSan library): it reads a file of cases,
// runs each through the plain C launchers of csrc/cuda/dlite_cuda.h and writes the outputs.
// python_tests/kernel_emu.py builds and drives both; python_tests/ops/test_kernel_emulation.py holds
// the grid.
#define DLITE_EMU_IMPLEMENTATION
#include "simt.h"

#include <vector>

#include "dlite_cuda.h"

extern "C" {

void dlite_emu_configure(int max_smem_optin, int reverse) {
  dlite_emu::device().max_smem_optin = max_smem_optin;
  dlite_emu::device().reverse = reverse != 0;
}

const char* dlite_emu_message() { return dlite_emu::message().c_str(); }

void dlite_emu_reset() {
  dlite_emu::message().clear();
  dlite_emu::last_error() = cudaSuccess;
  dlite_emu::stats() = dlite_emu::Stats{};
}

int dlite_emu_peek_last_error() { return static_cast<int>(cudaPeekAtLastError()); }

// launches, blocks, threads, fiber switches, __syncthreads completed, warp collectives completed
void dlite_emu_stats(long* out) {
  const dlite_emu::Stats& s = dlite_emu::stats();
  out[0] = s.launches;
  out[1] = s.blocks;
  out[2] = s.threads;
  out[3] = s.switches;
  out[4] = s.barriers;
  out[5] = s.collectives;
}

// The 16-bit conversions, for an exhaustive comparison with torch's.
void dlite_emu_to_bf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(in[i]).x;
}
void dlite_emu_to_f16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __float2half_rn(in[i]).x;
}
void dlite_emu_from_bf16(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __bfloat162float(__nv_bfloat16{in[i]});
}
void dlite_emu_from_f16(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = __half2float(__half{in[i]});
}

}  // extern "C"

#ifdef DLITE_EMU_DRIVER
// Case file: records of
//   int32 op, int32 dtype, int32 n_int, int32 n_inputs, int64 ints[n_int], float eps,
//   n_inputs x (int64 nbytes, bytes), int64 output nbytes
// ops: 0 assemble (B L C H K), 1 attention (B S Hq Hkv D L C causal), 2 scan (B K R),
//      3 argmax (M V), 4 configure (smem_optin reverse; no inputs, no output)
// Output file: per case int32 rc, int64 nbytes, bytes, int32 message length, message.
#include <stdio.h>

namespace {
template <typename T>
bool get(FILE* f, T* v, size_t n = 1) {
  return fread(v, sizeof(T), n, f) == n;
}
template <typename T>
void put(FILE* f, const T* v, size_t n = 1) {
  fwrite(v, sizeof(T), n, f);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s CASES OUTPUTS\n", argv[0]);
    return 2;
  }
  FILE* in = fopen(argv[1], "rb");
  FILE* out = fopen(argv[2], "wb");
  if (!in || !out) {
    fprintf(stderr, "cannot open %s or %s\n", argv[1], argv[2]);
    return 2;
  }
  int failures = 0;
  for (int n_case = 0;; ++n_case) {
    int32_t head[4];
    if (!get(in, head, 4)) break;
    const int op = head[0], dtype = head[1];
    std::vector<int64_t> ints(static_cast<size_t>(head[2]));
    float eps = 0.f;
    if (!get(in, ints.data(), ints.size()) || !get(in, &eps)) return 3;
    std::vector<std::vector<char>> inputs(static_cast<size_t>(head[3]));
    for (auto& buf : inputs) {
      int64_t nb = 0;
      if (!get(in, &nb)) return 3;
      buf.resize(static_cast<size_t>(nb));
      if (nb && !get(in, buf.data(), buf.size())) return 3;
    }
    int64_t out_nb = 0;
    if (!get(in, &out_nb)) return 3;
    std::vector<char> o(static_cast<size_t>(out_nb) + 1);
    dlite_emu_reset();
    const int64_t* I = ints.data();
    auto ptr = [&](size_t i) { return static_cast<const void*>(inputs[i].data()); };
    int rc = 0;
    switch (op) {
      case 0:
        rc = dlite_assemble_round_inputs_cuda(dtype, ptr(0), ptr(1), ptr(2), ptr(3), ptr(4), o.data(),
                                              I[0], I[1], I[2], I[3], I[4], eps, nullptr);
        break;
      case 1:
        rc = dlite_round_attention_cuda(dtype, ptr(0), ptr(1), ptr(2),
                                        static_cast<const float*>(ptr(3)),
                                        static_cast<const float*>(ptr(4)),
                                        static_cast<const uint8_t*>(ptr(5)), o.data(), I[0], I[1],
                                        I[2], I[3], I[4], I[5], I[6], static_cast<int>(I[7]), nullptr);
        break;
      case 2:
        rc = dlite_lowrank_rnn_scan_cuda(dtype, ptr(0), ptr(1), o.data(), I[0], I[1], I[2], nullptr);
        break;
      case 3:
        rc = dlite_rowwise_argmax_cuda(dtype, ptr(0), reinterpret_cast<int64_t*>(o.data()), I[0], I[1],
                                       nullptr);
        break;
      case 4:
        dlite_emu_configure(static_cast<int>(I[0]), static_cast<int>(I[1]));
        break;
      default:
        fprintf(stderr, "case %d: unknown op %d\n", n_case, op);
        return 3;
    }
    const std::string msg = dlite_emu_message();
    if (rc || !msg.empty()) ++failures;
    const int32_t rc32 = rc, ml = static_cast<int32_t>(msg.size());
    put(out, &rc32);
    put(out, &out_nb);
    put(out, o.data(), static_cast<size_t>(out_nb));
    put(out, &ml);
    put(out, msg.data(), msg.size());
  }
  fclose(in);
  fclose(out);
  fprintf(stderr, "kernel-check driver: %d case(s) failed\n", failures);
  return 0;
}
#endif
