// How far ahead of its reads a decode GEMV asks for its weights (simd_bf16.h, prefetch_ahead).
//
// 5 KiB: on the 2-core Zen 5 VM the best of 2.5, 5, 10 and 20 KiB in real decode steps with the
// host's memory in its fast state, and better than 10 KiB in its slow state too (docs/profile.md,
// "Which distance, measured in decode"). Another CPU may want another distance:
// LLAMA_NPU_STREAM_AHEAD sets it (cpu_kernels/native_cpu.py), for comparisons; a prefetch moves
// no data the kernel sees, so the distance never changes a result.
#include <atomic>
#include <cstdint>

namespace {

constexpr int64_t kDefaultAhead = 5 * 1024;
std::atomic<int64_t> g_ahead{kDefaultAhead};

}  // namespace

namespace native {

int64_t stream_ahead() { return g_ahead.load(std::memory_order_relaxed); }

}  // namespace native

// bytes > 0 sets the distance; 0 restores the default.
extern "C" void stream_ahead_set(int64_t bytes) { g_ahead.store(bytes > 0 ? bytes : kDefaultAhead); }

extern "C" int64_t stream_ahead_bytes() { return native::stream_ahead(); }
