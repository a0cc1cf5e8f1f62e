// Shared by every kernel: the bf16 element type, exact f32 <-> bf16 conversions and the
// compile-time helpers the kernels size themselves with.
//
// Two builds read this header. Peano (AIE target, `__AIENGINE__` defined) gets the AIE API
// `bfloat16` type; the host compiler gets a 16-bit struct with the same layout, so the same
// `extern "C"` signatures link from MLIR on the device and load through ctypes in tests.
#pragma once

#include <stdint.h>

#if defined(__AIENGINE__)
#include <aie_api/aie.hpp>
using bf16 = bfloat16;
#else
struct bf16 {
  uint16_t bits;
};
#endif

static_assert(sizeof(bf16) == 2, "bf16 buffers are 16-bit in every build");

#define KRESTRICT __restrict

// Widening is exact: a bf16 is the upper half of an f32.
static inline float bf16_to_f32(bf16 v) {
  uint32_t u = uint32_t(__builtin_bit_cast(uint16_t, v)) << 16;
  return __builtin_bit_cast(float, u);
}

// Round to nearest, ties to even, in integer arithmetic so the result does not depend on a
// compiler's or a core's floating-point rounding mode. NaNs stay NaN (quieted) instead of
// being carried into infinity by the rounding increment.
static inline bf16 f32_to_bf16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return __builtin_bit_cast(bf16, uint16_t((u >> 16) | 0x0040u));
  u += 0x7fffu + ((u >> 16) & 1u);
  return __builtin_bit_cast(bf16, uint16_t(u >> 16));
}

// 1/sqrt(n) at compile time: the AIE runtime has no libm to call, and the attention scale
// is a constant of the compiled head size anyway.
// Heron's iteration converges from any positive start; 64 steps are far more than any head
// size needs to reach the double nearest sqrt(n).
constexpr float inv_sqrt(int n) {
  double s = n;
  for (int i = 0; i < 64; ++i)
    s = 0.5 * (s + n / s);
  return float(1.0 / s);
}
