// y = W x in bf16 with f32 accumulation, for the simulated NPU's decode GEMVs on the host CPU.
//
// torch's bf16 matrix-vector product is compute-bound on CPUs without AMX (it widens to f32
// element by element), so decode would run at a fraction of memory bandwidth. AVX512-BF16's
// dot-product instruction multiplies bf16 pairs and accumulates in f32 at full vector width,
// which makes the GEMV memory-bound as it should be. Rows are split between the calling
// threads (the Python side runs one call per thread on disjoint row ranges); four rows share
// each load of x. The result is rounded to bf16 once per row, nearest-even.
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace {

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline __m512bh load(const uint16_t *p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

}  // namespace

extern "C" int gemv_bf16_cpu_supported() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

// Rows [r0, r1) of y = W x; W row-major [M, K]. K need not be a multiple of 32.
extern "C" void gemv_bf16_cpu(const uint16_t *w, const uint16_t *x, uint16_t *y,
                              int64_t k, int64_t r0, int64_t r1) {
  const int64_t full = k / 32 * 32;
  const __mmask32 tail = k == full ? 0 : static_cast<__mmask32>((1ull << (k - full)) - 1);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const uint16_t *a = w + r * k, *b = a + k, *c = b + k, *d = c + k;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < full; i += 32) {
      __m512bh xv = load(x + i, ~0u);
      s0 = _mm512_dpbf16_ps(s0, load(a + i, ~0u), xv);
      s1 = _mm512_dpbf16_ps(s1, load(b + i, ~0u), xv);
      s2 = _mm512_dpbf16_ps(s2, load(c + i, ~0u), xv);
      s3 = _mm512_dpbf16_ps(s3, load(d + i, ~0u), xv);
    }
    if (tail) {
      __m512bh xv = load(x + full, tail);
      s0 = _mm512_dpbf16_ps(s0, load(a + full, tail), xv);
      s1 = _mm512_dpbf16_ps(s1, load(b + full, tail), xv);
      s2 = _mm512_dpbf16_ps(s2, load(c + full, tail), xv);
      s3 = _mm512_dpbf16_ps(s3, load(d + full, tail), xv);
    }
    y[r] = to_bf16(_mm512_reduce_add_ps(s0));
    y[r + 1] = to_bf16(_mm512_reduce_add_ps(s1));
    y[r + 2] = to_bf16(_mm512_reduce_add_ps(s2));
    y[r + 3] = to_bf16(_mm512_reduce_add_ps(s3));
  }
  for (; r < r1; ++r) {
    const uint16_t *a = w + r * k;
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 32) s = _mm512_dpbf16_ps(s, load(a + i, ~0u), load(x + i, ~0u));
    if (tail) s = _mm512_dpbf16_ps(s, load(a + full, tail), load(x + full, tail));
    y[r] = to_bf16(_mm512_reduce_add_ps(s));
  }
}
