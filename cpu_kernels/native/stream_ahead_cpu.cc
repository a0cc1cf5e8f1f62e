// How far ahead of its reads a decode GEMV asks for its weights (simd_bf16.h, prefetch_ahead).
//
// The distance that pays is about what one core consumes in a memory latency, so it follows the
// core's share of the bandwidth, and each class has its own default, measured in real decode
// steps (docs/profile.md, "Which distance, measured in decode"):
// - AVX-512 classes, 5 KiB: on the 2-core Zen 5 VM (70-80 GB/s) the best of 2.5, 5, 10 and
//   20 KiB with the host's memory in its fast state, and better than 10 KiB in its slow state;
// - AVX2 classes, 1 KiB: on the 2-core Zen 3 VM (20-25 GB/s) 7.7 % faster than 5 KiB in Q4NX
//   decode and 5 % in bf16 decode; 0.3 KiB and 2.5 KiB lost to it. AVX2-only CPUs are the older
//   ones, with less bandwidth a core; on an AVX-512 CPU with AVX2 forced, the old 5 KiB may win.
// Another CPU may want another distance: LLAMA_NPU_STREAM_AHEAD sets it
// (cpu_kernels/native_cpu.py); a prefetch moves no data the kernel sees, so the distance never
// changes a result.
#include <atomic>
#include <cstdint>

namespace {

#if defined(__AVX512F__)
constexpr int64_t kDefaultAhead = 5 * 1024;
#else
constexpr int64_t kDefaultAhead = 1024;
#endif
std::atomic<int64_t> g_ahead{kDefaultAhead};

}  // namespace

namespace native {

int64_t stream_ahead() { return g_ahead.load(std::memory_order_relaxed); }

}  // namespace native

// bytes > 0 sets the distance; 0 restores the default.
extern "C" void stream_ahead_set(int64_t bytes) { g_ahead.store(bytes > 0 ? bytes : kDefaultAhead); }

extern "C" int64_t stream_ahead_bytes() { return native::stream_ahead(); }
