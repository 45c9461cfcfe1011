// SIMT host emulation: runs the CUDA kernels of csrc/cuda/*.cu, compiled from the same source by
// g++, on the CPU (make kernel-check). Not a simulator of timing; a checker of semantics:
//
//   - every CUDA thread of a block is a fiber with its own stack; blocks run one after another;
//   - __syncthreads() is a block barrier, __syncwarp() and __shfl_*_sync() exchange through the
//     warp; each checks its rules (every non-exited thread of the block at the same
//     __syncthreads, every lane named in a mask present at the same collective, shuffle sources
//     inside the mask) and a violation or a deadlock fails the launch with a message;
//   - dynamic shared memory is one exactly-sized allocation per launch, refilled with 0xff bytes
//     (NaN as float) before every block, so a read before a write shows in the output and an
//     access past the end shows under AddressSanitizer; static __shared__ arrays are per kernel;
//   - launches are checked like the driver checks them (block size, grid size, dynamic shared
//     memory against 48 KiB or the cudaFuncSetAttribute opt-in, the opt-in against the device's
//     limit) and report through cudaGetLastError(), which clears the error as CUDA's does;
//   - under ThreadSanitizer every thread is a TSan fiber switched without synchronisation, and
//     only the barriers (and the launch) create happens-before: a shared-memory access that no
//     barrier orders against a conflicting one is reported as a data race;
//   - bf16/fp16 are 16-bit host types with round-to-nearest-even conversions (CUDA's _rn).
//
// The .cu routes its launches through DLITE_LAUNCH and its dynamic shared memory through
// DLITE_DYNAMIC_SMEM (defined here; nvcc gets the <<<>>> / extern __shared__ forms). x86-64 only
// (the fiber switch is 20 instructions of assembly).
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#define DLITE_EMU_TSAN 1
#include <sanitizer/tsan_interface.h>
// exported by the TSan runtime, not declared by every compiler's tsan_interface.h
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif
#if defined(__SANITIZE_ADDRESS__)
#define DLITE_EMU_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#error "the SIMT host emulation (csrc/emu) switches fibers with x86-64 assembly"
#endif

// ------------------------------------------------------------------------------ CUDA keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

// ------------------------------------------------------------------------------ runtime types
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
};
typedef struct CUstream_st* cudaStream_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
constexpr int warpSize = 32;

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// ------------------------------------------------------------------------------ bf16 / fp16
struct __nv_bfloat16 {
  uint16_t x;
};
struct __half {
  uint16_t x;
};

inline float float_of_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint32_t bits_of_float(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float __bfloat162float(__nv_bfloat16 h) { return float_of_bits(static_cast<uint32_t>(h.x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = bits_of_float(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};  // NaN: CUDA's canonical bf16 NaN
  u += 0x7fffu + ((u >> 16) & 1u);                        // round to nearest, ties to even
  return {static_cast<uint16_t>(u >> 16)};
}
inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.x & 0x8000u) << 16;
  const uint32_t e = (h.x >> 10) & 0x1fu, m = h.x & 0x3ffu;
  if (e == 0)  // zero or subnormal: exact
    return float_of_bits(sign | bits_of_float(ldexpf(static_cast<float>(m), -24)));
  if (e == 31) return float_of_bits(sign | 0x7f800000u | (m << 13));
  return float_of_bits(sign | ((e + 112u) << 23) | (m << 13));
}
inline __half __float2half_rn(float f) {
  uint32_t x = bits_of_float(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (x >= 0x47800000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // >= 2^16: inf
  if (x >= 0x38800000u) {                                                // normal half (>= 2^-14)
    uint32_t r = x - 0x38000000u;                                        // exponent rebias 127 -> 15
    r += 0x0fffu + ((r >> 13) & 1u);                                     // ties to even; may carry to inf
    return {static_cast<uint16_t>(sign | (r >> 13))};
  }
  if (x < 0x33000000u) return {sign};  // below 2^-25 (2^-25 itself is a tie to 0)
  const uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // the value in units of 2^-24 is m >> shift
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
  return {static_cast<uint16_t>(sign | r)};
}

// ------------------------------------------------------------------------------ the emulator
extern "C" void dlite_emu_switch(void** save_sp, void* load_sp);

namespace dlite_emu {

// Callee-saved registers, MXCSR and the x87 control word: what a call must preserve. Emitted by
// the one translation unit that defines DLITE_EMU_IMPLEMENTATION (kernel_check.cpp).
#ifdef DLITE_EMU_IMPLEMENTATION
asm(R"(
  .text
  .globl dlite_emu_switch
  .type dlite_emu_switch,@function
dlite_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dlite_emu_switch,.-dlite_emu_switch
)");
#endif

// The emulated device: limits a launch is checked against (sm_90 by default: H100/H200/H800).
struct Device {
  int max_smem_default = 48 * 1024;  // without the opt-in attribute
  int max_smem_optin = 232448;       // cudaDevAttrMaxSharedMemoryPerBlockOptin (sm_80: 166912)
  int max_threads = 1024;
  int sm_count = 132;
  bool reverse = false;  // run threads (and blocks) in reverse order: a schedule perturbation
};
inline Device& device() {
  static Device d;
  return d;
}
inline cudaError_t& last_error() {
  static cudaError_t e = cudaSuccess;
  return e;
}
inline std::string& message() {  // the first rule violation since the last reset ("" if none)
  static std::string m;
  return m;
}
struct Stats {
  long launches = 0, blocks = 0, threads = 0, switches = 0, barriers = 0, collectives = 0;
};
inline Stats& stats() {
  static Stats s;
  return s;
}
inline std::vector<std::pair<const void*, int>>& func_smem_optin() {
  static std::vector<std::pair<const void*, int>> v;
  return v;
}

enum State : int { kRun = 0, kAtBlock = 1, kAtWarp = 2, kDone = 3 };
enum Op : int { kSyncwarp = 1, kShuffle = 2 };

struct Lane {
  void* sp = nullptr;
  char* stack = nullptr;
  uint3 tid{0, 0, 0};
  int linear = 0;
  int state = kRun;
  unsigned mask = 0;  // collective in progress
  int op = 0;
  int src = 0;
  uint64_t value = 0, result = 0;
  unsigned block_gen = 0, warp_gen = 0;
  const char* file = "";
  int line = 0;
#ifdef DLITE_EMU_TSAN
  void* fiber = nullptr;
#endif
#ifdef DLITE_EMU_ASAN
  void* fake_stack = nullptr;
#endif
};

struct Block {
  std::vector<Lane> lanes;
  uint3 bid{0, 0, 0};
  dim3 bdim, gdim;
  char* smem = nullptr;
  size_t smem_bytes = 0;
  void* sched_sp = nullptr;
  const std::function<void()>* body = nullptr;
  std::atomic<Lane*> cur{nullptr};  // relaxed: the scheduler's hand-over is not a kernel sync
  bool failed = false;
  char block_sync[2] = {0, 0};  // TSan happens-before objects (their addresses are what counts)
  char warp_sync[32][2] = {};
  char end_sync = 0;
#ifdef DLITE_EMU_TSAN
  void* host_fiber = nullptr;
#endif
#ifdef DLITE_EMU_ASAN
  const void* host_stack = nullptr;
  size_t host_stack_size = 0;
#endif
};
inline Block*& current_block() {
  static Block* b = nullptr;
  return b;
}
inline Lane& current_lane() { return *current_block()->cur.load(std::memory_order_relaxed); }

// The emulator's own bookkeeping is shared between fibers and the scheduler without
// synchronisation by design; TSan must look only at the kernel's accesses.
struct Quiet {
#ifdef DLITE_EMU_TSAN
  Quiet() { __tsan_ignore_thread_begin(); }
  ~Quiet() { __tsan_ignore_thread_end(); }
#else
  Quiet() {}
  ~Quiet() {}
#endif
};

inline constexpr size_t kStack = 256 * 1024;

inline void fail(const std::string& why) {
  Quiet q;
  Block* b = current_block();
  if (b) b->failed = true;
  if (message().empty()) message() = why;
  last_error() = cudaErrorLaunchFailure;
}

// A lane hands control back to the scheduler (at a barrier, a collective, or its end).
inline void lane_yield(Lane& l) {
  Block& b = *current_block();
#ifdef DLITE_EMU_TSAN
  __tsan_switch_to_fiber(b.host_fiber, __tsan_switch_to_fiber_no_sync);
#endif
#ifdef DLITE_EMU_ASAN
  __sanitizer_start_switch_fiber(&l.fake_stack, b.host_stack, b.host_stack_size);
#endif
  dlite_emu_switch(&l.sp, b.sched_sp);
#ifdef DLITE_EMU_ASAN
  __sanitizer_finish_switch_fiber(l.fake_stack, &b.host_stack, &b.host_stack_size);
#endif
}

[[noreturn]] inline void lane_entry() {
  Block& b = *current_block();
  Lane& l = current_lane();
#ifdef DLITE_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.host_stack, &b.host_stack_size);
#endif
  (*b.body)();
  {
    Quiet q;
    l.state = kDone;
  }
  void* to = b.sched_sp;  // read the block's fields before the release below ends the fiber's part
#ifdef DLITE_EMU_ASAN
  const void* host_stack = b.host_stack;
  const size_t host_stack_size = b.host_stack_size;
#endif
#ifdef DLITE_EMU_TSAN
  void* host = b.host_fiber;
  __tsan_release(&b.end_sync);
  __tsan_switch_to_fiber(host, __tsan_switch_to_fiber_no_sync);
#endif
#ifdef DLITE_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, host_stack, host_stack_size);
#endif
  void* dead;
  dlite_emu_switch(&dead, to);
  __builtin_unreachable();
}

inline void lane_start(Lane& l) {
#ifdef DLITE_EMU_ASAN
  // the frames of the stack's previous fiber never returned: their redzones are still poisoned
  __asan_unpoison_memory_region(l.stack, kStack);
#endif
  // The first switch into a lane "returns" into lane_entry with the stack aligned as after a call.
  uintptr_t top = (reinterpret_cast<uintptr_t>(l.stack) + kStack) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
  uint32_t csr;
  uint16_t cw;
  asm volatile("stmxcsr %0" : "=m"(csr));
  asm volatile("fnstcw %0" : "=m"(cw));
  memset(sp, 0, 72);  // nine slots; the last (top - 8) is a null return address for unwinders
  memcpy(sp, &csr, 4);
  memcpy(reinterpret_cast<char*>(sp) + 4, &cw, 2);
  sp[7] = reinterpret_cast<uint64_t>(&lane_entry);  // after r15 r14 r13 r12 rbx rbp
  l.sp = sp;
}

inline void resume(Block& b, Lane& l) {
  b.cur.store(&l, std::memory_order_relaxed);
  ++stats().switches;
#ifdef DLITE_EMU_TSAN
  __tsan_switch_to_fiber(l.fiber, __tsan_switch_to_fiber_no_sync);
#endif
#ifdef DLITE_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, l.stack, kStack);
#endif
  dlite_emu_switch(&b.sched_sp, l.sp);
#ifdef DLITE_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

inline std::string where(const Block& b) {
  char s[96];
  snprintf(s, sizeof s, "block (%u,%u,%u)", b.bid.x, b.bid.y, b.bid.z);
  return s;
}

// After every lane ran until it blocked: complete the collectives and barriers that can be.
// Returns false when nothing can run any more (done, failed or deadlocked).
inline bool resolve(Block& b) {
  Quiet q;
  const int n = static_cast<int>(b.lanes.size());
  bool progress = false;
  for (int w0 = 0; w0 < n; w0 += 32) {
    const int wn = n - w0 < 32 ? n - w0 : 32;
    Lane* first = nullptr;
    for (int i = 0; i < wn; ++i)
      if (b.lanes[w0 + i].state == kAtWarp) {
        first = &b.lanes[w0 + i];
        break;
      }
    if (!first) continue;
    const unsigned mask = first->mask;
    bool complete = true;
    for (int i = 0; i < 32; ++i) {
      Lane* l = i < wn ? &b.lanes[w0 + i] : nullptr;
      const bool named = (mask >> i) & 1u;
      if (named && !l) {
        fail(where(b) + ": warp " + std::to_string(w0 / 32) + ": mask names lane " +
             std::to_string(i) + ", which this block does not have");
        return false;
      }
      if (!l) continue;
      if (l->state == kAtWarp && (l->mask != mask || l->op != first->op)) {
        fail(where(b) + ": warp " + std::to_string(w0 / 32) +
             ": lanes wait at different warp collectives (masks or intrinsics differ)");
        return false;
      }
      if (!named) continue;
      if (l->state == kDone) {
        fail(where(b) + ": warp " + std::to_string(w0 / 32) + ": lane " + std::to_string(i) +
             " named in the mask of a collective at " + first->file + ":" +
             std::to_string(first->line) + " has exited");
        return false;
      }
      if (l->state != kAtWarp) complete = false;
    }
    if (!complete) continue;
    ++stats().collectives;
    for (int i = 0; i < wn; ++i) {
      Lane& l = b.lanes[w0 + i];
      if (!((mask >> i) & 1u)) continue;
      if (l.op == kShuffle) {
        if (!((mask >> l.src) & 1u) || l.src >= wn) {
          fail(where(b) + ": shuffle at " + std::string(l.file) + ":" + std::to_string(l.line) +
               ": lane " + std::to_string(i) + " reads lane " + std::to_string(l.src) +
               ", which is not in the mask");
          return false;
        }
        l.result = b.lanes[w0 + l.src].value;
      }
      l.state = kRun;
    }
    progress = true;
  }
  int at_block = 0, done = 0, running = 0;
  const Lane* bar = nullptr;
  for (const Lane& l : b.lanes) {
    if (l.state == kAtBlock) {
      ++at_block;
      if (!bar) bar = &l;
    } else if (l.state == kDone) {
      ++done;
    } else if (l.state == kRun) {
      ++running;
    }
  }
  if (at_block && at_block + done == n) {
    if (done) {
      fail(where(b) + ": __syncthreads at " + bar->file + ":" + std::to_string(bar->line) +
           " reached by " + std::to_string(at_block) + " of " + std::to_string(n) +
           " threads; the others have exited");
      return false;
    }
    for (const Lane& l : b.lanes)
      if (l.line != bar->line || strcmp(l.file, bar->file) != 0) {
        fail(where(b) + ": threads wait at different __syncthreads (" + bar->file + ":" +
             std::to_string(bar->line) + " and " + l.file + ":" + std::to_string(l.line) + ")");
        return false;
      }
    ++stats().barriers;
    for (Lane& l : b.lanes) l.state = kRun;
    return true;
  }
  if (progress || running) return true;
  if (done == n) return false;
  std::string s = where(b) + ": deadlock: ";
  int shown = 0;
  for (const Lane& l : b.lanes) {
    if (l.state == kDone || shown >= 4) continue;
    s += "thread " + std::to_string(l.linear) +
         (l.state == kAtBlock ? " at __syncthreads " : " at a warp collective ") + l.file + ":" +
         std::to_string(l.line) + "; ";
    ++shown;
  }
  fail(s + std::to_string(at_block) + " at __syncthreads, " + std::to_string(done) + " exited");
  return false;
}

inline void run_block(Block& b) {
  const int n = static_cast<int>(b.lanes.size());
  for (;;) {
    bool any = false;
    for (int k = 0; k < n; ++k) {
      Lane& l = b.lanes[device().reverse ? n - 1 - k : k];
      int st;
      {
        Quiet q;
        st = l.state;
      }
      if (st != kRun) continue;
      resume(b, l);
      any = true;
      Quiet q;
      if (b.failed) return;
    }
    if (!resolve(b) && !any) return;
    Quiet q;
    if (b.failed) return;
    bool left = false;
    {
      Quiet q;
      for (const Lane& l : b.lanes) left |= l.state != kDone;
    }
    if (!left) return;
  }
}

inline size_t optin_of(const void* f) {
  for (auto& p : func_smem_optin())
    if (p.first == f) return static_cast<size_t>(p.second);
  return 0;
}

inline cudaError_t set_error(cudaError_t e) {
  last_error() = e;
  return e;
}

inline void launch_grid(const void* kernel, dim3 g, dim3 bd, size_t smem,
                        const std::function<void()>& body) {
  Device& dev = device();
  const long threads = static_cast<long>(bd.x) * bd.y * bd.z;
  if (threads < 1 || threads > dev.max_threads || bd.z > 64) {
    set_error(cudaErrorInvalidConfiguration);
    return;
  }
  if (g.x < 1 || g.y < 1 || g.z < 1 || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) {
    set_error(cudaErrorInvalidConfiguration);
    return;
  }
  const size_t allowed = smem <= static_cast<size_t>(dev.max_smem_default)
                             ? static_cast<size_t>(dev.max_smem_default)
                             : optin_of(kernel);
  if (smem > allowed || smem > static_cast<size_t>(dev.max_smem_optin)) {
    set_error(cudaErrorInvalidValue);  // what the driver answers: "invalid argument"
    return;
  }
  ++stats().launches;
  Block b;
  b.bdim = bd;
  b.gdim = g;
  b.body = &body;
  b.smem_bytes = smem;
  b.smem = smem ? static_cast<char*>(malloc(smem)) : nullptr;
  b.lanes.resize(static_cast<size_t>(threads));
  for (long t = 0; t < threads; ++t) {
    Lane& l = b.lanes[static_cast<size_t>(t)];
    l.linear = static_cast<int>(t);
    l.tid = {static_cast<unsigned>(t % bd.x), static_cast<unsigned>((t / bd.x) % bd.y),
             static_cast<unsigned>(t / (static_cast<long>(bd.x) * bd.y))};
    l.stack = static_cast<char*>(malloc(kStack));
  }
  Block* saved = current_block();
  current_block() = &b;
#ifdef DLITE_EMU_TSAN
  b.host_fiber = __tsan_get_current_fiber();
#endif
  const long nblocks = static_cast<long>(g.x) * g.y * g.z;
  for (long k = 0; k < nblocks && !b.failed; ++k) {
    const long idx = dev.reverse ? nblocks - 1 - k : k;
    b.bid = {static_cast<unsigned>(idx % g.x), static_cast<unsigned>((idx / g.x) % g.y),
             static_cast<unsigned>(idx / (static_cast<long>(g.x) * g.y))};
    if (b.smem) memset(b.smem, 0xff, smem);  // uninitialised shared memory reads as NaN
    for (Lane& l : b.lanes) {
      Quiet q;
      l.state = kRun;
      l.block_gen = l.warp_gen = 0;
      lane_start(l);
#ifdef DLITE_EMU_TSAN
      l.fiber = __tsan_create_fiber(0);  // created by the host: ordered after the launch
#endif
    }
    ++stats().blocks;
    stats().threads += threads;
    run_block(b);
#ifdef DLITE_EMU_TSAN
    for (Lane& l : b.lanes) __tsan_destroy_fiber(l.fiber);
    __tsan_acquire(&b.end_sync);
#endif
  }
  current_block() = saved;
  for (Lane& l : b.lanes) free(l.stack);
  free(b.smem);
}

template <typename... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  template <typename... A>
  void operator()(A&&... a) const {
    static_assert(sizeof...(A) == sizeof...(P), "kernel launched with the wrong number of arguments");
    std::tuple<P...> args(static_cast<P>(std::forward<A>(a))...);
    auto k = kernel;
    const std::function<void()> body = [&args, k]() { std::apply(k, args); };
    launch_grid(reinterpret_cast<const void*>(kernel), grid, block, smem, body);
  }
};
template <typename... P>
Launch<P...> make_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t) {
  return Launch<P...>{kernel, grid, block, smem};
}

// ------------------------------------------------------------------------------ device side
inline void syncthreads(const char* file, int line) {
  Lane& l = current_lane();
  Block& b = *current_block();
  const unsigned g = l.block_gen & 1u;
#ifdef DLITE_EMU_TSAN
  __tsan_release(&b.block_sync[g]);
#endif
  {
    Quiet q;
    l.state = kAtBlock;
    l.file = file;
    l.line = line;
  }
  lane_yield(l);
  {
    Quiet q;
    ++l.block_gen;
  }
#ifdef DLITE_EMU_TSAN
  __tsan_acquire(&b.block_sync[g]);
#else
  (void)g;
  (void)b;
#endif
}

inline uint64_t warp_op(int op, unsigned mask, uint64_t value, int src, const char* file, int line) {
  Lane& l = current_lane();
  Block& b = *current_block();
  const int lane = l.linear % 32, warp = l.linear / 32;
  if (!((mask >> lane) & 1u)) {
    fail(where(b) + ": lane " + std::to_string(lane) + " of warp " + std::to_string(warp) +
         " calls a warp collective at " + file + ":" + std::to_string(line) +
         " with a mask that does not name it");
    lane_yield(l);  // the block is abandoned; never resumed
  }
  const unsigned g = l.warp_gen & 1u;
#ifdef DLITE_EMU_TSAN
  __tsan_release(&b.warp_sync[warp][g]);
#endif
  {
    Quiet q;
    l.state = kAtWarp;
    l.op = op;
    l.mask = mask;
    l.value = value;
    l.src = src;
    l.file = file;
    l.line = line;
  }
  lane_yield(l);
  uint64_t r;
  {
    Quiet q;
    ++l.warp_gen;
    r = l.result;
  }
#ifdef DLITE_EMU_TSAN
  __tsan_acquire(&b.warp_sync[warp][g]);
#else
  (void)g;
  (void)warp;
#endif
  return r;
}

template <typename T>
inline T shuffle(unsigned mask, T v, int src, const char* file, int line) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  uint64_t raw = 0;
  memcpy(&raw, &v, sizeof(T));
  raw = warp_op(kShuffle, mask, raw, src, file, line);
  T out;
  memcpy(&out, &raw, sizeof(T));
  return out;
}

inline int lane_id() { return current_lane().linear % 32; }

inline void* dynamic_smem() { return current_block()->smem; }

}  // namespace dlite_emu

// ------------------------------------------------------------------------------ CUDA API
#define threadIdx (::dlite_emu::current_lane().tid)
#define blockIdx (::dlite_emu::current_block()->bid)
#define blockDim (::dlite_emu::current_block()->bdim)
#define gridDim (::dlite_emu::current_block()->gdim)

#define DLITE_LAUNCH(kernel, grid, block, smem, stream) \
  ::dlite_emu::make_launch(kernel, dim3(grid), dim3(block), (smem), (stream))
#define DLITE_DYNAMIC_SMEM(T, name) T* name = static_cast<T*>(::dlite_emu::dynamic_smem())

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  dlite_emu::syncthreads(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  dlite_emu::warp_op(dlite_emu::kSyncwarp, mask, 0, 0, file, line);
}
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const int lane = dlite_emu::lane_id(), base = lane & ~(width - 1);
  return dlite_emu::shuffle(mask, v, base + (src & (width - 1)), file, line);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const int lane = dlite_emu::lane_id();
  int src = lane ^ lane_mask;
  if (src >= ((lane / width) + 1) * width) src = lane;
  return dlite_emu::shuffle(mask, v, src, file, line);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const int lane = dlite_emu::lane_id();
  int src = lane + static_cast<int>(delta);
  if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
  return dlite_emu::shuffle(mask, v, src, file, line);
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = dlite_emu::last_error();
  dlite_emu::last_error() = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return dlite_emu::last_error(); }
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return "unknown error";
  }
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int device) {
  if (device != 0) return dlite_emu::set_error(cudaErrorInvalidValue);
  const dlite_emu::Device& d = dlite_emu::device();
  switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = d.max_smem_optin; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = d.max_smem_default; return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock: *v = d.max_threads; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *v = d.sm_count; return cudaSuccess;
  }
  return dlite_emu::set_error(cudaErrorInvalidValue);
}
template <typename F>
inline cudaError_t cudaFuncSetAttribute(F* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      value > dlite_emu::device().max_smem_optin)
    return dlite_emu::set_error(cudaErrorInvalidValue);
  const void* key = reinterpret_cast<const void*>(func);
  for (auto& p : dlite_emu::func_smem_optin())
    if (p.first == key) {
      p.second = value;
      return cudaSuccess;
    }
  dlite_emu::func_smem_optin().emplace_back(key, value);
  return cudaSuccess;
}
