// The simulated device's weight format: 16x2 tiles, each bf16 held losslessly in 12 bits.
//
// Decode reads every weight once per token and waits on memory for nearly all of it, so the
// bytes a weight occupies set the token rate. A bf16 weight spends 8 bits on its exponent,
// yet a trained (or initialised) matrix uses few exponents: the 8 most used exponent pairs
// (exponent >> 1) hold all but 1e-4 to 1e-3 of its values. So each weight keeps the low byte of
// its bf16 as it is (the exponent's last bit and the mantissa) and a 4-bit nibble for the high
// byte (sign, and which of the matrix's 8 pairs), and the few 64-value units holding any other
// exponent are kept whole beside the rest. The high byte is then one 16-entry byte lookup
// (vpshufb) and the bf16 is one byte interleave (vpunpck*bw) of low and high bytes: a few
// instructions per 32 weights on AVX2 as on AVX-512, fewer than the cycles their bytes take
// to arrive, and the products are bit for bit those of bf16: nothing about the arithmetic
// changes.
//
// Layout of W[n][k] (n a multiple of 16, k of 4), all offsets in bytes from the buffer's start:
//   header   64 bytes: int64 pairs (byte i: the exponent pair that index i stands for),
//            int64 escapes, n, k
//   units    [n/16 blocks][k/4 units][96]: a unit is two K-pairs of a block's 16 rows, i.e.
//            two 64-byte tile vectors A and B of 32 values each (element e = row % 16 * 2 + k % 2),
//            each value at byte position q(e) = e with bits 3 and 4 swapped:
//              32 bytes of nibbles: byte q(e) = nibble(A[e]) | nibble(B[e]) << 4,
//                                   nibble = sign << 3 | index of exponent >> 1 among the pairs
//              32 bytes: byte q(e) = low byte of A[e]
//              32 bytes: byte q(e) = low byte of B[e]
//            (q is the order a 128-bit-lane byte interleave turns back into e: bytes 0-7 and
//            16-23 widen to elements 0-15, bytes 8-15 and 24-31 to 16-31)
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
constexpr int kPairs = 8;            // exponent pairs a nibble can stand for

struct Header {
  int64_t pairs, escapes, n, k;
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

// nibble -> the high byte of the bf16 it stands for (sign, exponent >> 1), for all 16 nibbles.
inline void high_bytes(int64_t pairs, uint8_t out[16]) {
  for (int i = 0; i < 16; ++i) out[i] = static_cast<uint8_t>((i >> 3) << 7 | (pairs >> (8 * (i & 7)) & 0x7F));
}

#if NATIVE_AVX512
// The 16 high bytes in each 128-bit lane, for vpshufb.
struct Table {
  __m512i t;
  explicit Table(int64_t pairs = 0) {
    alignas(16) uint8_t v[16];
    high_bytes(pairs, v);
    t = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i *>(v)));
  }
};

// One unit's two tile vectors, as bf16 bits. The nibbles go in twice, A's (low) in the lower
// half and B's (high) in the upper, so one lookup makes the 64 high bytes beside the 64 low ones.
inline void decode_unit(const uint8_t *c, const Table &table, native::P16 &a, native::P16 &b) {
  const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(c)));
  const __m512i nibbles = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4), _mm512_set1_epi8(0x0F));
  const __m512i high = _mm512_shuffle_epi8(table.t, nibbles);
  const __m512i low = _mm512_loadu_si512(c + 32);
  // Lanes 0-1 of each interleave are A's, lanes 2-3 B's; unpacklo holds elements 0-15, unpackhi 16-31.
  const __m512i lo = _mm512_unpacklo_epi8(low, high), hi = _mm512_unpackhi_epi8(low, high);
  a.v = _mm512_shuffle_i64x2(lo, hi, 0x44);
  b.v = _mm512_shuffle_i64x2(lo, hi, 0xEE);
}
#else
struct Table {
  __m256i t;
  explicit Table(int64_t pairs = 0) {
    alignas(16) uint8_t v[16];
    high_bytes(pairs, v);
    t = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i *>(v)));
  }
};

// One unit's two tile vectors, as bf16 bits: each interleave of 16 low and 16 high bytes is
// one half of a tile vector (pairs 0-7 from unpacklo, 8-15 from unpackhi), with no lane crossing.
inline void decode_unit(const uint8_t *c, const Table &table, native::P16 &a, native::P16 &b) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(c));
  const __m256i ha = _mm256_shuffle_epi8(table.t, _mm256_and_si256(codes, nibble));
  const __m256i hb = _mm256_shuffle_epi8(table.t, _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble));
  const __m256i la = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(c + 32));
  const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(c + 64));
  a.lo = _mm256_unpacklo_epi8(la, ha);
  a.hi = _mm256_unpackhi_epi8(la, ha);
  b.lo = _mm256_unpacklo_epi8(lb, hb);
  b.hi = _mm256_unpackhi_epi8(lb, hb);
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
    table = Table(h.pairs);
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
