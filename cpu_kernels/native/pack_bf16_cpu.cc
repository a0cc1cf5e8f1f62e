// Row-major bf16 weights into the packed tiles of packed_tiles.h, once per weight upload.
//
// A plan picks the matrix's 8 exponent pairs and sizes the buffer: the pairs are the ones most
// used in a sample of the values (any 8 are correct; the most used leave fewer units whole),
// and the count of units that must be kept whole is exact. Packing flags those units again (the
// plan's result does not cross the C interface), then takes a block of 16 rows at a time: it
// puts the block in tile order through a small buffer and encodes 16 or 32 values per vector
// instruction.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "packed_tiles.h"
#include "simd_bf16.h"

namespace {

using packed::kLanes;
using packed::kPairs;

constexpr int64_t kSample = 1 << 20;   // values the pairs are chosen on

// The exponent pair (exponent >> 1) of each bf16 of a vector, and its index among the
// matrix's pairs (0 where it has none, which only escaped units hold).
#if NATIVE_AVX512
// Pair -> index as a 128-entry table of 16-bit lanes (kUnknown where the matrix has no index),
// read by two 64-entry permutes: a handful of instructions per 32 values, whatever the pairs.
constexpr short kUnknown = static_cast<short>(0x8000);
struct Pairs {
  __m512i table[4];
  explicit Pairs(int64_t pairs) {
    alignas(64) int16_t t[128];
    std::fill(t, t + 128, kUnknown);
    for (int i = kPairs - 1; i >= 0; --i) t[pairs >> (8 * i) & 0x7F] = static_cast<int16_t>(i);
    for (int j = 0; j < 4; ++j) table[j] = _mm512_load_si512(t + 32 * j);
  }
  __m512i lookup(__m512i v) const {
    const __m512i p = _mm512_and_si512(_mm512_srli_epi16(v, 8), _mm512_set1_epi16(0x7F));
    const __m512i low = _mm512_permutex2var_epi16(table[0], p, table[1]);     // index bit 5 picks the table
    const __m512i high = _mm512_permutex2var_epi16(table[2], p, table[3]);
    return _mm512_mask_blend_epi16(_mm512_test_epi16_mask(p, _mm512_set1_epi16(64)), low, high);
  }
  __mmask32 known(__m512i v) const { return _mm512_testn_epi16_mask(lookup(v), _mm512_set1_epi16(kUnknown)); }
  __m512i index(__m512i v) const { return _mm512_and_si512(lookup(v), _mm512_set1_epi16(kPairs - 1)); }
};

// Bit i set for each of the first min(left, 32) values p[i] whose pair the matrix has none for.
inline uint32_t outside(const uint16_t *p, int64_t left, const Pairs &pairs) {
  const __mmask32 lanes = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
  return ~pairs.known(_mm512_maskz_loadu_epi16(lanes, p)) & lanes;
}
#else
struct Pairs {
  __m256i pair[kPairs];
  explicit Pairs(int64_t pairs) {
    for (int i = 0; i < kPairs; ++i) pair[i] = _mm256_set1_epi16(static_cast<short>(pairs >> (8 * i) & 0x7F));
  }
  static __m256i of(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 8), _mm256_set1_epi16(0x7F)); }
  __m256i known(__m256i v) const {   // all-ones lanes
    const __m256i p = of(v);
    __m256i m = _mm256_setzero_si256();
    for (int i = 0; i < kPairs; ++i) m = _mm256_or_si256(m, _mm256_cmpeq_epi16(p, pair[i]));
    return m;
  }
  __m256i index(__m256i v) const {
    const __m256i p = of(v);
    __m256i idx = _mm256_setzero_si256();
    for (int i = 1; i < kPairs; ++i)
      idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_cmpeq_epi16(p, pair[i]),
                                                   _mm256_set1_epi16(static_cast<short>(i))));
    return idx;
  }
};

inline uint32_t outside(const uint16_t *p, int64_t left, const Pairs &pairs) {
  alignas(32) uint16_t tail[32] = {};
  if (left < 32) {
    std::memcpy(tail, p, left * sizeof(uint16_t));
    p = tail;
  }
  const __m256i lo = pairs.known(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
  const __m256i hi = pairs.known(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 16)));
  // packs interleaves the halves by 128-bit lane; the permute puts the 32 bytes back in order.
  const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xD8);
  const uint32_t known = static_cast<uint32_t>(_mm256_movemask_epi8(bytes));
  return ~known & (left >= 32 ? ~uint32_t{0} : (uint32_t{1} << left) - 1);
}
#endif

// flags[b * units + u] = 1 for every unit u of block b holding a value whose exponent pair the
// matrix has no index for, found on the row-major values. Packing reads the block counts (for
// where each block's whole units go) and the flags themselves from this one pass.
std::vector<uint8_t> escaped_units(const uint16_t *w, int64_t n, int64_t k, int64_t table) {
  const int64_t blocks = n / kLanes, units = packed::units(k);
  const Pairs pairs(table);
  std::vector<uint8_t> flags(blocks * units, 0);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t *f = flags.data() + b * units;
    for (int64_t r = 0; r < kLanes; ++r) {
      const uint16_t *row = w + (b * kLanes + r) * k;
      for (int64_t c = 0; c < k; c += 32)
        for (uint32_t bad = outside(row + c, k - c, pairs); bad; bad &= bad - 1) f[(c + __builtin_ctz(bad)) / 4] = 1;
    }
  }
  return flags;
}

// One unit (tile vectors a, b) into its 96 bytes: nibbles, A's low bytes, B's low bytes, each
// at byte position q(e).
#if NATIVE_AVX512
// Bytes of 32 16-bit lanes (element order) in the stored order q: quarters 0, 2, 1, 3.
inline __m256i stored(__m512i words) { return _mm256_permute4x64_epi64(_mm512_cvtepi16_epi8(words), 0xD8); }
inline __m512i nibbles(__m512i v, const Pairs &pairs) {
  return _mm512_or_si512(_mm512_slli_epi16(_mm512_srli_epi16(v, 15), 3), pairs.index(v));
}

void encode_unit(native::P16 a, native::P16 b, const Pairs &pairs, uint8_t *out) {
  const __m256i na = stored(nibbles(a.v, pairs)), nb = stored(nibbles(b.v, pairs));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), _mm256_or_si256(na, _mm256_slli_epi16(nb, 4)));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 32), stored(a.v));   // the narrowing keeps low bytes
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 64), stored(b.v));
}
#else
// packus of elements 0-15 and 16-31 interleaves them by 128-bit lane, which is the order q.
inline __m256i stored(__m256i lo, __m256i hi) { return _mm256_packus_epi16(lo, hi); }
inline __m256i nibbles(__m256i v, const Pairs &pairs) {
  return _mm256_or_si256(_mm256_slli_epi16(_mm256_srli_epi16(v, 15), 3), pairs.index(v));
}
inline __m256i low(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi16(0xFF)); }

void encode_unit(native::P16 a, native::P16 b, const Pairs &pairs, uint8_t *out) {
  const __m256i na = stored(nibbles(a.lo, pairs), nibbles(a.hi, pairs));
  const __m256i nb = stored(nibbles(b.lo, pairs), nibbles(b.hi, pairs));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), _mm256_or_si256(na, _mm256_slli_epi16(nb, 4)));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 32), stored(low(a.lo), low(a.hi)));
  _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + 64), stored(low(b.lo), low(b.hi)));
}
#endif

}  // namespace

// The matrix's 8 exponent pairs, one per byte (into *table), and the packed size in bytes of W[n][k].
extern "C" int64_t pack_weight_bf16_cpu_plan(const uint16_t *w, int64_t n, int64_t k, int64_t *table) {
  int64_t hist[128] = {0};
  const int64_t total = n * k, step = total > kSample ? total / kSample : 1;
  for (int64_t i = 0; i < total; i += step) ++hist[(w[i] >> 8) & 0x7F];
  int order[128];
  for (int i = 0; i < 128; ++i) order[i] = i;
  // Most used first; among equals the lower pair, so that the choice does not depend on the sort.
  std::stable_sort(order, order + 128, [&](int x, int y) { return hist[x] > hist[y]; });
  int64_t pairs = 0;
  for (int i = 0; i < kPairs; ++i) pairs |= static_cast<int64_t>(order[i]) << (8 * i);
  *table = pairs;
  const std::vector<uint8_t> flags = escaped_units(w, n, k, pairs);
  return packed::Layout(n, k).nbytes(std::count(flags.begin(), flags.end(), 1));
}

// W[n][k] packed into out, which holds pack_weight_bf16_cpu_plan's bytes for this table.
extern "C" void pack_weight_bf16_cpu(const uint16_t *w, int64_t n, int64_t k, int64_t table, uint8_t *out) {
  const packed::Layout at(n, k);
  const int64_t blocks = at.blocks, units = at.units, words = at.words, kp = k / 2;
  const std::vector<uint8_t> escaped = escaped_units(w, n, k, table);
  const Pairs pairs(table);
  std::vector<int64_t> starts(blocks + 1, 0);
  for (int64_t b = 0; b < blocks; ++b)
    starts[b + 1] = starts[b] + std::count(escaped.begin() + b * units, escaped.begin() + (b + 1) * units, 1);
  const packed::Header header{table, starts[blocks], n, k};
  std::memcpy(out, &header, sizeof header);
  uint8_t *unit = out + packed::kHeader;
  uint64_t *bitmap = reinterpret_cast<uint64_t *>(out + at.bitmap);
  int64_t *start_out = reinterpret_cast<int64_t *>(out + at.starts);
  uint16_t *raw = reinterpret_cast<uint16_t *>(out + at.escaped);
  std::memcpy(start_out, starts.data(), starts.size() * sizeof(int64_t));
  const uint32_t *src = reinterpret_cast<const uint32_t *>(w);
#pragma omp parallel
  {
    std::vector<uint32_t> tiles(kp * kLanes);   // one block in tile order: [K/2][16] pairs
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t *flags = escaped.data() + b * units;
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
          encode_unit(va, vb, pairs, c);
        }
      }
    }
  }
}
