// How far ahead of its reads a decode GEMV asks for its weights (simd_bf16.h, prefetch_ahead).
//
// The distance that pays is about what one core consumes in a memory latency: a property of
// the CPU and its memory, not of the instructions a class computes with. So the default is
// chosen by the CPU the library runs on, whichever class it was built for, from two
// measurements in real decode steps (docs/profile.md, "Which distance, measured in decode"):
// - 5 KiB on a CPU with AVX-512: on the 2-core Zen 5 VM (70-80 GB/s) the best of 2.5, 5, 10
//   and 20 KiB, in its fast and its slow state; its AVX2 class was measured at 5 KiB too;
// - 1 KiB on a CPU without it: on the 2-core Zen 3 VM (20-25 GB/s) 7.7 % faster than 5 KiB in
//   Q4NX decode and 5 % in bf16 decode; 0.3 and 2.5 KiB lost to it.
// AVX-512 marks the newer, wider cores with more bandwidth a core, which is what the distance
// follows. Another CPU may want another distance: LLAMA_NPU_STREAM_AHEAD sets it
// (cpu_kernels/native_cpu.py); a prefetch moves no data the kernel sees, so the distance never
// changes a result.
#include <atomic>
#include <cstdint>

#include "simd_bf16.h"

namespace {

constexpr int64_t kWideCoreAhead = 5 * 1024;
constexpr int64_t kNarrowCoreAhead = 1024;

// First asked by g_ahead's initializer, a constructor of this library: GCC's CPU model may not
// be filled in yet there, so it is filled in first (__builtin_cpu_init is idempotent).
int64_t default_ahead() {
  static const int64_t ahead = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? kWideCoreAhead : kNarrowCoreAhead;
  }();
  return ahead;
}

// The hint, by the CPU's maker. On a 2-core Intel Xeon VM (family 6, model 207) the Q4NX GEMV
// over 48 matrices from memory read 17.5 GB/s with NTA at 5 KiB and 25.1 with T0 (the f32
// stream: 29 GB/s), likely because an NTA prefetch there fills only the first-level cache, whose
// few fill buffers then cap the lines in flight (not measured). On the AMD VMs T0 was 1-2 % slower than NTA (Zen 5) or
// the same within the noise (Zen 3) (docs/profile.md, "Asking for the weights ahead").
bool default_t0() {
  static const bool t0 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return t0;
}

std::atomic<int64_t> g_ahead{default_ahead()};
std::atomic<int> g_t0{default_t0() ? 1 : 0};

}  // namespace

namespace native {

Ahead stream_ahead() {
  return {g_ahead.load(std::memory_order_relaxed), g_t0.load(std::memory_order_relaxed) != 0};
}

}  // namespace native

// bytes > 0 sets the distance; 0 restores the default.
extern "C" void stream_ahead_set(int64_t bytes) { g_ahead.store(bytes > 0 ? bytes : default_ahead()); }

extern "C" int64_t stream_ahead_bytes() { return native::stream_ahead().bytes; }

// hint 1: T0, 0: NTA, -1: the CPU's default.
extern "C" void stream_hint_set(int hint) { g_t0.store(hint < 0 ? (default_t0() ? 1 : 0) : hint != 0); }

extern "C" int stream_hint_t0() { return native::stream_ahead().t0 ? 1 : 0; }
