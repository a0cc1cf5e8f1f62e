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
// over 48 matrices from memory (huge pages, 5 KiB ahead, 2 threads) read, against the f32
// stream's 29-31 GB/s: `avx2` 18.7-19.3 GB/s with NTA, 25.3-27.0 with T0, 28.2-28.9 with T1;
// `avx512` 27.9-28.5 with T0, 28.6-30.4 with T1; the bf16 GEMV 24-26 and 26-26.6 with T0,
// 25-28 and 28-29 with T1. Likely because an NTA or a T0 prefetch holds one of the first-level
// cache's few fill buffers until its line arrives, which caps the lines in flight, while T1
// hands the request to the second level, whose queue holds more (not measured). On the AMD
// VMs NTA read 1-2 % more than T0 and 7 % more than T1 (Zen 5), and all three the same within
// the noise (Zen 3) (docs/profile.md, "Asking for the weights ahead" and the Zen 3's bench runs).
native::Hint default_hint() {
  static const native::Hint hint = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0 ? native::Hint::kT1 : native::Hint::kNta;
  }();
  return hint;
}

std::atomic<int64_t> g_ahead{default_ahead()};
std::atomic<int> g_hint{static_cast<int>(default_hint())};

}  // namespace

namespace native {

Ahead stream_ahead() {
  return {g_ahead.load(std::memory_order_relaxed), static_cast<Hint>(g_hint.load(std::memory_order_relaxed))};
}

}  // namespace native

// bytes > 0 sets the distance; 0 restores the default.
extern "C" void stream_ahead_set(int64_t bytes) { g_ahead.store(bytes > 0 ? bytes : default_ahead()); }

extern "C" int64_t stream_ahead_bytes() { return native::stream_ahead().bytes; }

// The hint as __builtin_prefetch's locality (0: NTA, 2: T1, 3: T0); -1 restores the CPU's default.
extern "C" void stream_hint_set(int locality) {
  g_hint.store(locality < 0 ? static_cast<int>(default_hint()) : locality);
}

extern "C" int stream_hint_locality() { return static_cast<int>(native::stream_ahead().hint); }
