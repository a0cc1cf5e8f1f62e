// Decode's activations in its fixed point (q4nx::fixed_point), as the Q4NX kernels' byte dot
// products read them: the GEMV (q4nx_cpu.cc) converts one activation row per call, prefill's
// integer GEMM (q4nx_gemm_cpu.cc) every row of A once per call, with the same code, so a
// prefill row and a decode step take the same numbers.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "q4nx_blocks.h"

namespace q4nx {

// Groups g0..g1 of one row in decode's fixed point (q4nx::fixed_point), as the byte dot products
// read it: unit u's 4 bytes at xh[step u]; wide, those are the high bytes Xh of X = 256 Xh + Xl
// and the low bytes Xl go to xl[step u] (narrow: X itself at xh, nothing at xl).
inline void convert_groups(const uint16_t *x, int64_t g0, int64_t g1, int32_t *xh, int32_t *xl, int64_t step,
                           float *unit, float *sum) {
  int16_t X[kGroup];
  int8_t h[kGroup], l[kGroup];
  for (int64_t g = g0; g < g1; ++g) {
    q4nx::fixed_point(x + g * kGroup, kGroup, X, unit + g, sum + g);
    for (int64_t i = 0; i < kGroup; ++i) {
      if (q4nx::kActBytes == 1)
        h[i] = static_cast<int8_t>(X[i]);
      else
        q4nx::split_bytes(X[i], h[i], l[i]);
    }
    for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; ++u) {
      const int64_t at = step * (g * kGroup / q4nx::kUnitCols + u);
      std::memcpy(xh + at, h + 4 * u, 4);
      if (q4nx::kActBytes == 2) std::memcpy(xl + at, l + 4 * u, 4);
    }
  }
}

// The same numbers for 8 groups at a time, vectorized: with the conversion per element in
// scalar code a prefill spent a tenth of its GEMM time in it (a GEMM converts M x K values).
//   - Each group's sum is added in fixed_point's order (element 0 first): the 8 groups are
//     transposed so that lane j is group j, and 32 vector adds run the 8 chains side by side.
//   - u = 2^(E - 140) for the biased exponent E of the group's largest |x| (frexp's e is E - 126
//     for a normal number); x / u is then x * 2^(140 - E), the same exact quotient and so the
//     same rounded one, and vcvtps2dq rounds to nearest even as nearbyint does. Where E < 14
//     (u or 1 / u not a normal float) or a group is all zeros, the 8 groups take the scalar code.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Groups xg.. (8 of them) transposed so that lane j is group j: each group's sum, added in
// fixed_point's order (element 0 first), and its largest |x|.
inline void group_stats8(const uint16_t *xg, __m256 &sum, __m256 &top) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  sum = top = _mm256_setzero_ps();
  for (int c = 0; c < kGroup / 8; ++c) {
    __m256 r[8];
    for (int j = 0; j < 8; ++j) r[j] = native::widen8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(xg + j * kGroup + 8 * c)));
    transpose8(r);
    for (int i = 0; i < 8; ++i) {
      sum = _mm256_add_ps(sum, r[i]);
      top = _mm256_max_ps(top, _mm256_and_ps(r[i], abs_mask));
    }
  }
}

// A vpshufb pattern: the low byte of each int32 of a 128-bit lane (4 columns' X) to bytes
// at .. at + 3 of that lane, the rest zero.
inline __m256i pick_low_bytes(int at) {
  alignas(32) int8_t p[32];
  for (int i = 0; i < 32; ++i) p[i] = -1;
  for (int lane = 0; lane < 2; ++lane)
    for (int i = 0; i < 4; ++i) p[16 * lane + at + i] = static_cast<int8_t>(4 * i);
  return _mm256_load_si256(reinterpret_cast<const __m256i *>(p));
}

#if NATIVE_AVX2
inline void convert_row_wide(const uint16_t *x, int64_t k, int32_t *hl, float *unit, float *sum) {
  const auto scalar = [&](int64_t g0, int64_t g1) { convert_groups(x, g0, g1, hl, hl + 1, 2, unit, sum); };
  const int64_t groups = k / kGroup;
  const __m256i pick_h = pick_low_bytes(0), pick_l = pick_low_bytes(4);   // one unit's Xh, then its Xl
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const uint16_t *xg = x + g * kGroup;
    __m256 s, top;
    group_stats8(xg, s, top);
    const __m256i e = _mm256_srli_epi32(_mm256_castps_si256(top), 23);
    if (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(14), e)))) {
      scalar(g, g + 8);
      continue;
    }
    _mm256_storeu_ps(sum + g, s);
    _mm256_storeu_ps(unit + g, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(13)), 23)));
    alignas(32) float inv[8];
    _mm256_store_ps(inv, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(267), e), 23)));
    for (int j = 0; j < 8; ++j) {
      const __m256 iu = _mm256_set1_ps(inv[j]);
      for (int c = 0; c < kGroup / 8; ++c) {   // 8 columns: 2 units
        const __m256 v = native::widen8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(xg + j * kGroup + 8 * c)));
        const __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(v, iu));
        const __m256i lo = _mm256_srai_epi32(_mm256_slli_epi32(X, 24), 24);
        const __m256i hi = _mm256_srai_epi32(_mm256_sub_epi32(X, lo), 8);
        const __m256i b = _mm256_or_si256(_mm256_shuffle_epi8(hi, pick_h), _mm256_shuffle_epi8(lo, pick_l));
        int32_t *dst = hl + 2 * ((g + j) * kGroup / q4nx::kUnitCols + 2 * c);
        _mm_storel_epi64(reinterpret_cast<__m128i *>(dst), _mm256_castsi256_si128(b));
        _mm_storel_epi64(reinterpret_cast<__m128i *>(dst + 2), _mm256_extracti128_si256(b, 1));
      }
    }
  }
  scalar(g, groups);
}
#endif

// Narrow (one byte, X = round(x * (127 / top)), u = top / 127): the same maxima, one
// f32 division per group for each of 127 / top and top / 127, the products rounded by
// vcvtps2dq (nearest even, as nearbyint), and the min's sum u * sum(X) from the integers. Where
// a group's top is below kNarrowFloor, the 8 groups take the scalar code.
inline void convert_row_narrow(const uint16_t *x, int64_t k, int32_t *xb, float *unit, float *sum) {
  const auto scalar = [&](int64_t g0, int64_t g1) { convert_groups(x, g0, g1, xb, nullptr, 1, unit, sum); };
  const int64_t groups = k / kGroup;
  const __m256 levels = _mm256_set1_ps(q4nx::kNarrowLevels);
  const __m256i pick = pick_low_bytes(0);   // one unit's 4 bytes
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const uint16_t *xg = x + g * kGroup;
    __m256 exact_sum, top;                  // (the narrow min takes u * sum(X), below)
    group_stats8(xg, exact_sum, top);
    if (_mm256_movemask_ps(_mm256_cmp_ps(top, _mm256_set1_ps(q4nx::kNarrowFloor), _CMP_GE_OQ)) != 0xff) {
      scalar(g, g + 8);
      continue;
    }
    _mm256_storeu_ps(unit + g, _mm256_div_ps(top, levels));
    alignas(32) float inv[8];
    _mm256_store_ps(inv, _mm256_div_ps(levels, top));
    for (int j = 0; j < 8; ++j) {
      const __m256 iu = _mm256_set1_ps(inv[j]);
      __m256i total = _mm256_setzero_si256();
      for (int c = 0; c < kGroup / 8; ++c) {   // 8 columns: 2 units
        const __m256 v = native::widen8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(xg + j * kGroup + 8 * c)));
        const __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(v, iu));
        total = _mm256_add_epi32(total, X);
        const __m256i b = _mm256_shuffle_epi8(X, pick);
        int32_t *dst = xb + (g + j) * kGroup / q4nx::kUnitCols + 2 * c;
        dst[0] = _mm256_extract_epi32(b, 0);
        dst[1] = _mm256_extract_epi32(b, 4);
      }
      // The min's sum (q4nx.group_sums): u times the exact integer sum of the group's X.
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
      sum[g + j] = static_cast<float>(_mm_cvtsi128_si32(t)) * unit[g + j];
    }
  }
  scalar(g, groups);
}

inline void convert_row(const uint16_t *x, int64_t k, int32_t *words, float *unit, float *sum) {
  if (q4nx::kActBytes == 1) {
    convert_row_narrow(x, k, words, unit, sum);
    return;
  }
#if NATIVE_AVX2
  convert_row_wide(x, k, words, unit, sum);
#else
  // Planes, as the AVX-512 GEMV reads them: all of a row's Xh, then all its Xl.
  convert_groups(x, 0, k / kGroup, words, words + k / q4nx::kUnitCols, 1, unit, sum);
#endif
}

// One row-block of decode's GEMV (q4nx_cpu.cc) on activations converted here: 32 outputs over all
// K. Declared once for both kernel files: the integer GEMM of the classes with wide AVX-512
// activations calls it row by row (q4nx_gemm_cpu.cc).
void gemv_row_block(const uint8_t *rb, int64_t k, const int32_t *xh, const int32_t *xl, const float *unit,
                    const float *sum, uint16_t *y, native::Ahead ahead);

}  // namespace q4nx
