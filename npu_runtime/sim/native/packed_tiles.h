// The simulated device's weight format: 16x2 tiles, each bf16 held losslessly in 12 bits.
//
// Decode reads every weight once per token and waits on memory for nearly all of it, so the
// bytes a weight occupies set the token rate. A bf16 weight spends 8 bits on its exponent,
// yet a trained (or initialised) matrix uses few exponents: 15 consecutive ones hold all but
// about 1e-4 of its values. Here each weight keeps its sign and 7 mantissa bits in a byte and
// its exponent as a 4-bit code (0: exponent 0, i.e. zero or subnormal; c in 1..15: base + c - 1),
// and the few 64-value units holding any other exponent are kept whole beside the rest. A
// vector of 32 weights decodes in a few instructions (four on AVX-512, a dozen on AVX2), fewer
// than the cycles its bytes take to arrive, and the products are bit for bit those of bf16:
// nothing about the arithmetic changes.
//
// Layout of W[n][k] (n a multiple of 16, k of 4), all offsets in bytes from the buffer's start:
//   header   64 bytes: int64 base, escapes, n, k
//   units    [n/16 blocks][k/4 units][96]: a unit is two K-pairs of a block's 16 rows, i.e.
//            two 64-byte tile vectors A and B of 32 values each (element e = row % 16 * 2 + k % 2):
//              32 bytes of codes: byte e = code(A[e]) | code(B[e]) << 4
//              64 bytes of sign|mantissa (s << 7 | m): 16-byte lane L = A[8L..8L+7], B[8L..8L+7]
//            (the byte order a lane-local shuffle widens to 16 bits without crossing lanes)
//   bitmap   [blocks][ceil(units/64)] uint64: bit u set = unit u is escaped (its 96 bytes unused)
//   starts   [blocks + 1] int64: index of each block's first escaped unit
//   escapes  [escapes][64] bf16: A then B, as plain tile vectors
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "simd_bf16.h"

namespace packed {

constexpr int64_t kLanes = 16;       // outputs per block
constexpr int64_t kHeader = 64;
constexpr int64_t kUnitBytes = 96;
constexpr int64_t kUnitValues = 64;
constexpr int kCodes = 15;           // exponents a code can stand for

struct Header {
  int64_t base, escapes, n, k;
};

inline int64_t units(int64_t k) { return k / 4; }   // per block: two K-pairs each

// Where each part of a packed [n][k] buffer starts, in bytes: the one place the offsets are derived.
struct Layout {
  int64_t blocks, units, words;   // blocks of 16 rows; units and bitmap words per block
  int64_t bitmap, starts, escaped;

  Layout(int64_t n, int64_t k)
      : blocks(n / kLanes), units(packed::units(k)), words((units + 63) / 64),
        bitmap(kHeader + blocks * units * kUnitBytes), starts(bitmap + blocks * words * 8),
        escaped(starts + (blocks + 1) * 8) {}

  int64_t nbytes(int64_t escapes) const { return escaped + escapes * kUnitValues * 2; }
};

// code -> exponent << 7 as bf16 bits: the exponent field a code stands for in a 16-bit lane.
inline uint16_t exponent_bits(int64_t base, int code) {
  return code ? static_cast<uint16_t>((base + code - 1) << 7) : 0;
}

#if NATIVE_AVX512BF16
// code -> exponent << 7, for 16-bit lanes; entries 16-31 repeat 0-15 (vpermw reads 5 index bits).
struct Table {
  __m512i t;
  explicit Table(int64_t base = 0) {
    alignas(64) uint16_t v[32];
    for (int i = 0; i < 32; ++i) v[i] = exponent_bits(base, i & 15);
    t = _mm512_load_si512(v);
  }
};

// One unit's two tile vectors, as bf16 bits.
inline void decode_unit(const uint8_t *c, const Table &table, native::P16 &a, native::P16 &b) {
  const __m512i dup_a = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
  const __m512i dup_b = _mm512_broadcast_i32x4(_mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15));
  const __m512i keep = _mm512_set1_epi16(static_cast<short>(0x807F));   // sign and mantissa of s|m s|m
  const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(c)));
  const __m512i sm = _mm512_loadu_si512(c + 32);
  // (dup & keep) | exponent: 0xEA is the truth table of (x & y) | z.
  a.v = _mm512_ternarylogic_epi32(_mm512_shuffle_epi8(sm, dup_a), keep, _mm512_permutexvar_epi16(codes, table.t), 0xEA);
  b.v = _mm512_ternarylogic_epi32(_mm512_shuffle_epi8(sm, dup_b), keep,
                                  _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table.t), 0xEA);
}
#else
// code -> exponent << 7, split into its low and high byte: two 16-entry vpshufb tables.
struct Table {
  __m256i lo, hi;
  explicit Table(int64_t base = 0) {
    alignas(16) uint8_t l[16], h[16];
    for (int i = 0; i < 16; ++i) l[i] = exponent_bits(base, i) & 0xFF, h[i] = exponent_bits(base, i) >> 8;
    lo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i *>(l)));
    hi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i *>(h)));
  }
  // 16-bit lanes holding a code (0-15) -> its exponent bits; code 0 looks up 0 in both tables,
  // which is what the empty byte of each lane reads.
  __m256i operator()(__m256i code) const {
    return _mm256_or_si256(_mm256_shuffle_epi8(lo, code), _mm256_shuffle_epi8(hi, _mm256_slli_epi16(code, 8)));
  }
};

// One unit's two tile vectors, as bf16 bits: each 32-byte half of the sign|mantissa bytes holds
// pairs 0-7 (lane 0) and 8-15 (lane 1) of both vectors, so no shuffle crosses a lane.
inline void decode_unit(const uint8_t *c, const Table &table, native::P16 &a, native::P16 &b) {
  const __m256i dup_a = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
  const __m256i dup_b = _mm256_broadcastsi128_si256(_mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15));
  const __m256i keep = _mm256_set1_epi16(static_cast<short>(0x807F));
  const __m256i nibble = _mm256_set1_epi16(0x0F);
  const __m256i c0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(c)));
  const __m256i c1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(c + 16)));
  const __m256i s0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(c + 32));
  const __m256i s1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(c + 64));
  auto merge = [&](__m256i sm, __m256i dup, __m256i code) {
    return _mm256_or_si256(_mm256_and_si256(_mm256_shuffle_epi8(sm, dup), keep), table(code));
  };
  a.lo = merge(s0, dup_a, _mm256_and_si256(c0, nibble));
  a.hi = merge(s1, dup_a, _mm256_and_si256(c1, nibble));
  b.lo = merge(s0, dup_b, _mm256_srli_epi16(c0, 4));
  b.hi = merge(s1, dup_b, _mm256_srli_epi16(c1, 4));
}
#endif

// A packed buffer as its readers walk it.
struct View {
  const uint8_t *unit;
  const uint64_t *bitmap;
  const int64_t *starts;
  const uint16_t *escaped;
  int64_t u, w;
  Table table;

  explicit View(const uint8_t *p) {
    const Header &h = *reinterpret_cast<const Header *>(p);
    const Layout at(h.n, h.k);
    u = at.units;
    w = at.words;
    unit = p + kHeader;
    bitmap = reinterpret_cast<const uint64_t *>(p + at.bitmap);
    starts = reinterpret_cast<const int64_t *>(p + at.starts);
    escaped = reinterpret_cast<const uint16_t *>(p + at.escaped);
    table = Table(h.base);
  }
};

// Reads one block's units in order: unit(u, a, b) gives its two tile vectors (K-pairs 2u, 2u + 1).
struct Cursor {
  const uint8_t *c;
  const uint64_t *bits;
  const uint16_t *raw;
  Table table;

  Cursor() = default;
  Cursor(const View &v, int64_t blk)
      : c(v.unit + blk * v.u * kUnitBytes), bits(v.bitmap + blk * v.w), raw(v.escaped + v.starts[blk] * kUnitValues),
        table(v.table) {}

  inline void unit(int64_t u, native::P16 &a, native::P16 &b) {
    if (bits[u >> 6] >> (u & 63) & 1) {
      a = native::load_pairs(raw);
      b = native::load_pairs(raw + 32);
      raw += kUnitValues;
    } else {
      decode_unit(c + u * kUnitBytes, table, a, b);
    }
  }
};

}  // namespace packed
