// Row-major bf16 weights into the packed tiles of packed_tiles.h, once per weight upload.
//
// A plan picks the exponent window and sizes the buffer: the window is the one that holds the
// most of a sample of the values (any window is correct; a good one leaves fewer units whole),
// and the count of units that must be kept whole is exact. Packing then takes a block of 16
// rows at a time: it finds the block's escaped units on the row-major values, puts the block in
// tile order through a small buffer, and encodes 32 values per vector instruction.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "packed_tiles.h"
#include "simd_bf16.h"

namespace {

using packed::kLanes;

constexpr int64_t kSample = 1 << 20;   // values the window is chosen on

// Bit i set for each of the first min(left, 32) values p[i] whose exponent no code stands for
// (codes stand for 0 and base..base+14).
#if NATIVE_AVX512BF16
inline uint32_t outside(const uint16_t *p, int64_t left, int64_t base) {
  const __mmask32 lanes = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
  const __m512i v = _mm512_maskz_loadu_epi16(lanes, p);
  const __m512i e = _mm512_and_si512(_mm512_srli_epi16(v, 7), _mm512_set1_epi16(0xFF));
  const __m512i off = _mm512_sub_epi16(e, _mm512_set1_epi16(static_cast<short>(base)));
  return _mm512_test_epi16_mask(e, e) & _mm512_cmpgt_epu16_mask(off, _mm512_set1_epi16(packed::kCodes - 1)) & lanes;
}
#else
inline __m256i outside16(__m256i v, int64_t base) {
  const __m256i e = _mm256_and_si256(_mm256_srli_epi16(v, 7), _mm256_set1_epi16(0xFF));
  const __m256i below = _mm256_cmpgt_epi16(_mm256_set1_epi16(static_cast<short>(base)), e);
  const __m256i above = _mm256_cmpgt_epi16(e, _mm256_set1_epi16(static_cast<short>(base + packed::kCodes - 1)));
  return _mm256_andnot_si256(_mm256_cmpeq_epi16(e, _mm256_setzero_si256()), _mm256_or_si256(below, above));
}
inline uint32_t outside(const uint16_t *p, int64_t left, int64_t base) {
  alignas(32) uint16_t tail[32] = {};   // zeros have exponent 0: never outside
  if (left < 32) {
    std::memcpy(tail, p, left * sizeof(uint16_t));
    p = tail;
  }
  const __m256i lo = outside16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)), base);
  const __m256i hi = outside16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 16)), base);
  // packs interleaves the halves by 128-bit lane; the permute puts the 32 bytes back in order.
  return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xD8)));
}
#endif

// flags[u] = 1 for every unit of block blk that holds a value outside the window.
void flag_escapes(const uint16_t *w, int64_t k, int64_t blk, int64_t base, std::vector<uint8_t> &flags) {
  flags.assign(packed::units(k), 0);
  for (int64_t r = 0; r < kLanes; ++r) {
    const uint16_t *row = w + (blk * kLanes + r) * k;
    for (int64_t c = 0; c < k; c += 32)
      for (uint32_t bad = outside(row + c, k - c, base); bad; bad &= bad - 1) flags[(c + __builtin_ctz(bad)) / 4] = 1;
  }
}

std::vector<int64_t> escapes_per_block(const uint16_t *w, int64_t n, int64_t k, int64_t base) {
  const int64_t blocks = n / kLanes;
  std::vector<int64_t> count(blocks, 0);
#pragma omp parallel
  {
    std::vector<uint8_t> flags;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      flag_escapes(w, k, b, base, flags);
      for (uint8_t f : flags) count[b] += f;
    }
  }
  return count;
}

// One unit (tile vectors a, b) into its 96 bytes: codes, then sign|mantissa by 16-byte lane.
#if NATIVE_AVX512BF16
// Codes (16-bit lanes) and sign|mantissa bytes (low byte of 16-bit lanes) of one tile vector.
inline void split(__m512i v, int64_t base, __m256i &codes, __m256i &sm) {
  const __m512i e = _mm512_and_si512(_mm512_srli_epi16(v, 7), _mm512_set1_epi16(0xFF));
  codes = _mm512_cvtepi16_epi8(_mm512_maskz_sub_epi16(_mm512_test_epi16_mask(e, e), e,
                                                      _mm512_set1_epi16(static_cast<short>(base - 1))));
  // (v >> 8 & 0x80) | (v & 0x7F): 0xE2 is the truth table of (x & y) | (~y & z) with y the mask.
  sm = _mm512_cvtepi16_epi8(_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), _mm512_set1_epi16(0x80), v, 0xE2));
}

void encode_unit(native::P16 a, native::P16 b, int64_t base, uint8_t *out) {
  __m256i ca, cb, sa, sb;
  split(a.v, base, ca, sa);
  split(b.v, base, cb, sb);
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), _mm256_or_si256(ca, _mm256_slli_epi16(cb, 4)));
  // 16-byte lane L = A[8L..8L+7], B[8L..8L+7]: alternate the two vectors' 8-byte quarters.
  const __m512i order = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
  _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi64(_mm512_castsi256_si512(sa), order,
                                                          _mm512_castsi256_si512(sb)));
}
#else
// Codes and sign|mantissa (s << 7 | m) of 16 values, each in the low byte of its 16-bit lane.
inline __m256i codes16(__m256i v, int64_t base) {
  const __m256i e = _mm256_and_si256(_mm256_srli_epi16(v, 7), _mm256_set1_epi16(0xFF));
  return _mm256_andnot_si256(_mm256_cmpeq_epi16(e, _mm256_setzero_si256()),
                             _mm256_sub_epi16(e, _mm256_set1_epi16(static_cast<short>(base - 1))));
}
inline __m256i sm16(__m256i v) {
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 8), _mm256_set1_epi16(0x80)),
                         _mm256_and_si256(v, _mm256_set1_epi16(0x7F)));
}

void encode_unit(native::P16 a, native::P16 b, int64_t base, uint8_t *out) {
  // packus interleaves its operands by 128-bit lane: for the codes the permute restores the
  // order; for sign|mantissa that interleaving is the stored order (lane L: A's 8, then B's 8).
  const __m256i ca = _mm256_permute4x64_epi64(_mm256_packus_epi16(codes16(a.lo, base), codes16(a.hi, base)), 0xD8);
  const __m256i cb = _mm256_permute4x64_epi64(_mm256_packus_epi16(codes16(b.lo, base), codes16(b.hi, base)), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), _mm256_or_si256(ca, _mm256_slli_epi16(cb, 4)));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 32), _mm256_packus_epi16(sm16(a.lo), sm16(b.lo)));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 64), _mm256_packus_epi16(sm16(a.hi), sm16(b.hi)));
}
#endif

}  // namespace

// The window's base exponent (into *base) and the packed size in bytes of W[n][k].
extern "C" int64_t pack_weight_bf16_cpu_plan(const uint16_t *w, int64_t n, int64_t k, int64_t *base) {
  int64_t hist[256] = {0};
  const int64_t total = n * k, step = total > kSample ? total / kSample : 1;
  for (int64_t i = 0; i < total; i += step) ++hist[(w[i] >> 7) & 0xFF];
  int64_t best = 1, covered = -1;
  for (int64_t b = 1; b + packed::kCodes <= 255; ++b) {   // exponent 255 (inf, NaN) always escapes
    int64_t s = 0;
    for (int c = 0; c < packed::kCodes; ++c) s += hist[b + c];
    if (s > covered) best = b, covered = s;
  }
  *base = best;
  int64_t escapes = 0;
  for (int64_t c : escapes_per_block(w, n, k, best)) escapes += c;
  return packed::Layout(n, k).nbytes(escapes);
}

// W[n][k] packed into out, which holds pack_weight_bf16_cpu_plan's bytes for this base.
extern "C" void pack_weight_bf16_cpu(const uint16_t *w, int64_t n, int64_t k, int64_t base, uint8_t *out) {
  const packed::Layout at(n, k);
  const int64_t blocks = at.blocks, units = at.units, words = at.words, kp = k / 2;
  const std::vector<int64_t> count = escapes_per_block(w, n, k, base);
  std::vector<int64_t> starts(blocks + 1, 0);
  for (int64_t b = 0; b < blocks; ++b) starts[b + 1] = starts[b] + count[b];
  const packed::Header header{base, starts[blocks], n, k};
  std::memcpy(out, &header, sizeof header);
  uint8_t *unit = out + packed::kHeader;
  uint64_t *bitmap = reinterpret_cast<uint64_t *>(out + at.bitmap);
  int64_t *start_out = reinterpret_cast<int64_t *>(out + at.starts);
  uint16_t *raw = reinterpret_cast<uint16_t *>(out + at.escaped);
  std::memcpy(start_out, starts.data(), starts.size() * sizeof(int64_t));
  const uint32_t *src = reinterpret_cast<const uint32_t *>(w);
#pragma omp parallel
  {
    std::vector<uint8_t> flags;
    std::vector<uint32_t> tiles(kp * kLanes);   // one block in tile order: [K/2][16] pairs
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      flag_escapes(w, k, b, base, flags);
      const uint32_t *rows = src + b * kLanes * kp;
      for (int64_t p = 0; p < kp; ++p)
        for (int64_t l = 0; l < kLanes; ++l) tiles[p * kLanes + l] = rows[l * kp + p];
      uint64_t *bits = bitmap + b * words;
      std::memset(bits, 0, words * sizeof(uint64_t));
      uint16_t *r = raw + starts[b] * packed::kUnitValues;
      for (int64_t u = 0; u < units; ++u) {
        uint8_t *c = unit + (b * units + u) * packed::kUnitBytes;
        const native::P16 va = native::load_pairs(&tiles[2 * u * kLanes]);
        const native::P16 vb = native::load_pairs(&tiles[(2 * u + 1) * kLanes]);
        if (flags[u]) {
          bits[u / 64] |= uint64_t{1} << (u % 64);
          std::memset(c, 0, packed::kUnitBytes);
          native::store_pairs(r, va);
          native::store_pairs(r + 32, vb);
          r += packed::kUnitValues;
        } else {
          encode_unit(va, vb, base, c);
        }
      }
    }
  }
}
