// Q4NX weights (llama_base/q4nx.py holds the layout; its numbers arrive here as -D defines from
// native_build.py, so the two cannot drift): what the CPU kernels need to read them.
//
// A row-block is 32 rows over all K, one contiguous run of 20 K bytes, with rows i and i + 16 in
// the low and high nibbles of one byte: a 16-lane half of a row-block is one mask or one shift
// away. The kernels read the simulated device's form of it (below), not the declared order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd_bf16.h"
#include "tiles_bf16.h"

#ifndef Q4NX_ROWS
#error "native_build.py passes the Q4NX layout and decode's activation contract (Q4NX_ROWS, Q4NX_COLS, ...)"
#endif

namespace q4nx {

constexpr int64_t kRows = Q4NX_ROWS;
constexpr int64_t kCols = Q4NX_COLS;
constexpr int64_t kGroup = Q4NX_GROUP;
constexpr int kFixedBits = Q4NX_FIXED_BITS;
// Decode's activation width for this library's class (q4nx.WIDE 2 or q4nx.NARROW 1): the bytes
// per activation its byte dot products take, and the int32 words per 4-column unit it stores.
constexpr int kActBytes = Q4NX_ACT_BYTES;
constexpr float kNarrowLevels = Q4NX_NARROW_LEVELS;
// Below it a narrow group counts as zeros (q4nx.NARROW_FLOOR_EXP): 127 / top must stay finite.
const float kNarrowFloor = std::ldexp(1.0f, Q4NX_NARROW_FLOOR_EXP);
static_assert(kActBytes == 1 || kActBytes == 2, "activations are one or two bytes wide");
constexpr int64_t kNibbleBytes = kRows / 2;                       // per column
constexpr int64_t kBytesPerCol = kNibbleBytes + 4 * kRows / kGroup;  // + a bf16 scale and min per row per group
static_assert(kRows == 2 * native::kWidth, "a row-block's halves are the two 16-lane vectors");
static_assert(kGroup % 4 == 0, "groups hold whole 4-column units");

// The activations as decode's contract takes them (q4nx.fixed_point, q4nx.gemv_reference): per
// group of kGroup, integers X in units u, and the sum its min multiplies (q4nx.group_sums).
// Wide: u = 2^(e - 14), the power of two below the group's largest |x| in [2^e, 2^(e+1)), and
// the exact sum. Narrow: X = x * (127 / top) rounded, u = top / 127, and u * sum(X). A group of
// zeros (narrow: below kNarrowFloor) has X = 0, u = 1.
inline void fixed_point(const uint16_t *x, int64_t k, int16_t *X, float *unit, float *sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    float v[kGroup], top = 0.0f, s = 0.0f;
    for (int64_t i = 0; i < kGroup; ++i) {
      const uint32_t bits = static_cast<uint32_t>(x[g * kGroup + i]) << 16;
      std::memcpy(&v[i], &bits, 4);
      top = std::fmax(top, std::fabs(v[i]));
      if (kActBytes == 2) s += v[i];   // narrow: the sum of X, below
    }
    float u = 1.0f;
    if (kActBytes == 1) {
      const bool live = top >= kNarrowFloor;
      const float r = live ? kNarrowLevels / top : 0.0f;
      if (live) u = top / kNarrowLevels;
      int32_t total = 0;
      for (int64_t i = 0; i < kGroup; ++i) {
        X[g * kGroup + i] = static_cast<int16_t>(std::nearbyint(v[i] * r));
        total += X[g * kGroup + i];
      }
      s = static_cast<float>(total) * u;   // q4nx.group_sums: the min sees the bytes' error too
    } else {
      int e = 0;
      std::frexp(top, &e);                       // top in [2^(e-1), 2^e)
      if (top > 0.0f) u = std::ldexp(1.0f, e - 1 - (kFixedBits - 1));
      for (int64_t i = 0; i < kGroup; ++i) X[g * kGroup + i] = static_cast<int16_t>(std::nearbyint(v[i] / u));
    }
    unit[g] = u;
    sum[g] = s;
  }
}

// X = 256 h + l as two signed bytes: |X| <= 2^kFixedBits = 2^14 puts h in [-64, 64] and l in [-128, 127].
inline void split_bytes(int16_t X, int8_t &h, int8_t &l) {
  l = static_cast<int8_t>(X & 0xff);
  h = static_cast<int8_t>((X - l) / 256);
}

// On the simulated device (weight_tiles.Q4nxPacking) a row-block is its groups in order, each
// one contiguous run: its values in units of 4 columns with the columns innermost (unit byte
// 4 i + t is column t's byte i, so 32-bit lane i of a 64-byte unit holds rows i, in the low
// nibbles, and i + 16, in the high ones, for 4 columns), then its 32 bf16 scales, then its 32
// bf16 mins.
constexpr int64_t kUnitCols = 4;
constexpr int64_t kUnitBytes = kUnitCols * kNibbleBytes;
constexpr int64_t kGroupBytes = kGroup * kBytesPerCol;

struct Group {
  const uint8_t *values;
  const uint16_t *scales, *mins;
};

inline Group group(const uint8_t *row_block, int64_t g) {
  const uint8_t *v = row_block + g * kGroupBytes;
  const uint16_t *s = reinterpret_cast<const uint16_t *>(v + kGroup * kNibbleBytes);
  return {v, s, s + kRows};
}

// The values of column t of a unit, one half of the rows, as floats: lane i is row i (+ 16).
#if NATIVE_AVX512
inline native::F16 unit_column(const uint8_t *unit, int t, int shift) {
  const __m512i v = _mm512_loadu_si512(unit);
  return {_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * t + shift), _mm512_set1_epi32(15)))};
}
// Two vectors rounded to bf16 (nearest-even; weights are finite) and paired: lane i = (odd << 16) | even.
inline native::P16 bf16_pairs(native::F16 even, native::F16 odd) {
  const auto rne = [](__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  };
  return {_mm512_or_si512(_mm512_slli_epi32(rne(odd.v), 16), rne(even.v))};
}
#else
inline __m256 column8(const uint8_t *p, int t, int shift) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t + shift), _mm256_set1_epi32(15)));
}
inline native::F16 unit_column(const uint8_t *unit, int t, int shift) {
  return {column8(unit, t, shift), column8(unit + 32, t, shift)};
}
inline __m256i rne8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}
inline native::P16 bf16_pairs(native::F16 even, native::F16 odd) {
  return {_mm256_or_si256(_mm256_slli_epi32(rne8(odd.lo), 16), rne8(even.lo)),
          _mm256_or_si256(_mm256_slli_epi32(rne8(odd.hi), 16), rne8(even.hi))};
}
#endif

// Dequantized weights as plain tile vectors for the GEMMs: 16-row block `blk` (the low or high
// half of row-block blk / 2), K-pair p at out + 16 p, each weight q * scale + min in f32 rounded
// to bf16 once (q4nx.dequantize's numbers), read from the device form.
struct Source final : native::BlockSource {
  const uint8_t *w;
  int64_t k;
  Source(const uint8_t *w_, int64_t k_) : w(w_), k(k_) {}

  void decode(int64_t blk, uint32_t *out) const override {
    const uint8_t *rb = w + blk / 2 * k * kBytesPerCol;
    const int shift = blk % 2 ? 4 : 0, half = static_cast<int>(blk % 2) * native::kWidth;
    for (int64_t g = 0; g < k / kGroup; ++g) {
      const Group grp = group(rb, g);
      const native::F16 s = native::load_bf16(grp.scales + half), m = native::load_bf16(grp.mins + half);
      for (int64_t j = 0; j < kGroup; j += kUnitCols) {
        native::F16 w4[kUnitCols];
        for (int t = 0; t < kUnitCols; ++t)
          w4[t] = native::add(native::mul(unit_column(grp.values + j * kNibbleBytes, t, shift), s), m);
        uint32_t *dst = out + (g * kGroup + j) / 2 * native::kWidth;
        native::store_pairs(dst, bf16_pairs(w4[0], w4[1]));
        native::store_pairs(dst + native::kWidth, bf16_pairs(w4[2], w4[3]));
      }
    }
  }
};

}  // namespace q4nx
