// Decode's GEMV on Q4NX weights in the simulated device's form (q4nx_blocks.h), with
// dequantization folded into the sums as the NPU's fused kernel folds it: per group of 32
// columns and per row,
//     y += (scale * u) * sum(q * X) + min * sum(x),
// X the activations as 14-bit integers in units of u (q4nx.fixed_point). sum(q * X) is an exact
// integer, so it comes out the same on every ISA class and in torch.
//
// The device form puts one row's values for 4 columns in each 32-bit lane, and X = 256 Xh + Xl
// splits into two signed bytes, so the sums are byte dot products: unsigned values times signed
// activation bytes, 4 per lane (vpdpbusd with AVX512-VNNI; vpmaddubsw into 16-bit sums on AVX2,
// widened once a group). A 64-byte unit (128 weights, both halves of 16 rows) costs one load, a
// mask, a shift and four dot products. With f32 FMAs (as the bf16 GEMV uses) or with 16-bit
// products the arithmetic, not memory, would set the token rate on a 2-core CPU.

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "q4nx_blocks.h"




namespace {

using q4nx::kBytesPerCol;
using q4nx::kGroup;
using q4nx::kNibbleBytes;
using q4nx::kRows;

struct Activations {
  std::vector<int32_t> hi, lo;   // per 4 columns: the bytes Xh, Xl of X = 256 Xh + Xl
  std::vector<float> unit, sum;
  Activations(const uint16_t *x, int64_t k) : hi(k / 4), lo(k / 4), unit(k / kGroup), sum(k / kGroup) {
    std::vector<int16_t> X(k);
    q4nx::fixed_point(x, k, X.data(), unit.data(), sum.data());
    std::vector<int8_t> h(k), l(k);
    for (int64_t i = 0; i < k; ++i) {
      l[i] = static_cast<int8_t>(X[i] & 0xff);
      h[i] = static_cast<int8_t>((X[i] - l[i]) / 256);
    }
    std::memcpy(hi.data(), h.data(), k);
    std::memcpy(lo.data(), l.data(), k);
  }
};

#if NATIVE_AVX512BF16

// The integer sums of one group for rows 0-15 (lo) and 16-31 (hi): two sets of accumulators
// take alternate units, to cover the dot product's latency.
inline void group_sums(const uint8_t *values, const int32_t *xh, const int32_t *xl, __m512i &lo, __m512i &hi) {
  const __m512i nib = _mm512_set1_epi8(15);
  __m512i a[8];
  for (auto &v : a) v = _mm512_setzero_si512();
  for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; u += 2) {
    for (int64_t s = 0; s < 2; ++s) {
      const __m512i v = _mm512_loadu_si512(values + (u + s) * q4nx::kUnitBytes);
      const __m512i ql = _mm512_and_si512(v, nib), qh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      const __m512i h = _mm512_set1_epi32(xh[u + s]), l = _mm512_set1_epi32(xl[u + s]);
      a[4 * s + 0] = _mm512_dpbusd_epi32(a[4 * s + 0], ql, h);
      a[4 * s + 1] = _mm512_dpbusd_epi32(a[4 * s + 1], ql, l);
      a[4 * s + 2] = _mm512_dpbusd_epi32(a[4 * s + 2], qh, h);
      a[4 * s + 3] = _mm512_dpbusd_epi32(a[4 * s + 3], qh, l);
    }
  }
  lo = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a[0], a[4]), 8), _mm512_add_epi32(a[1], a[5]));
  hi = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a[2], a[6]), 8), _mm512_add_epi32(a[3], a[7]));
}

inline void group_f32(const uint8_t *values, const int32_t *xh, const int32_t *xl, native::F16 &lo, native::F16 &hi) {
  __m512i il, ih;
  group_sums(values, xh, xl, il, ih);
  lo = {_mm512_cvtepi32_ps(il)};
  hi = {_mm512_cvtepi32_ps(ih)};
}

#else  // NATIVE_AVX2: 8 rows per vector; 16-bit sums within a group (at most 8 * 2 * 15 * 128 < 2^15)

inline __m256i widen_sum(__m256i h16, __m256i l16) {
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(h16, ones), 8), _mm256_madd_epi16(l16, ones));
}

inline void group_f32(const uint8_t *values, const int32_t *xh, const int32_t *xl, native::F16 &lo, native::F16 &hi) {
  const __m256i nib = _mm256_set1_epi8(15);
  __m256i a[8];   // [rows 0-7 | 8-15][low nibbles x Xh, x Xl, high nibbles x Xh, x Xl]
  for (auto &v : a) v = _mm256_setzero_si256();
  // Unrolled whole, GCC computes every product of the group before adding any and spills them.
#pragma GCC unroll 2
  for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; ++u) {
    const __m256i h = _mm256_set1_epi32(xh[u]), l = _mm256_set1_epi32(xl[u]);
    for (int64_t r = 0; r < 2; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(values + u * q4nx::kUnitBytes + 32 * r));
      const __m256i ql = _mm256_and_si256(v, nib), qh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      a[4 * r + 0] = _mm256_add_epi16(a[4 * r + 0], _mm256_maddubs_epi16(ql, h));
      a[4 * r + 1] = _mm256_add_epi16(a[4 * r + 1], _mm256_maddubs_epi16(ql, l));
      a[4 * r + 2] = _mm256_add_epi16(a[4 * r + 2], _mm256_maddubs_epi16(qh, h));
      a[4 * r + 3] = _mm256_add_epi16(a[4 * r + 3], _mm256_maddubs_epi16(qh, l));
    }
  }
  lo = {_mm256_cvtepi32_ps(widen_sum(a[0], a[1])), _mm256_cvtepi32_ps(widen_sum(a[4], a[5]))};
  hi = {_mm256_cvtepi32_ps(widen_sum(a[2], a[3])), _mm256_cvtepi32_ps(widen_sum(a[6], a[7]))};
}

#endif

// One row-block: 32 outputs over all K, read as one forward stream.
void gemv_row_block(const uint8_t *rb, int64_t k, const Activations &act, uint16_t *y) {
  native::F16 y_lo = native::zero(), y_hi = native::zero();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const q4nx::Group grp = q4nx::group(rb, g);
    const int64_t unit0 = g * kGroup / q4nx::kUnitCols;
    native::F16 s_lo, s_hi;
    group_f32(grp.values, act.hi.data() + unit0, act.lo.data() + unit0, s_lo, s_hi);
    const native::F16 u = native::set1(act.unit[g]), xs = native::set1(act.sum[g]);
    y_lo = native::fma(s_lo, native::mul(native::load_bf16(grp.scales), u), y_lo);
    y_hi = native::fma(s_hi, native::mul(native::load_bf16(grp.scales + native::kWidth), u), y_hi);
    y_lo = native::fma(native::load_bf16(grp.mins), xs, y_lo);
    y_hi = native::fma(native::load_bf16(grp.mins + native::kWidth), xs, y_hi);
  }
  native::store_bf16(y, y_lo);
  native::store_bf16(y + native::kWidth, y_hi);
}

constexpr int64_t kChunkBytes = 1024 * 1024;   // as the bf16 GEMV: long streams, dozens of chunks a batch

struct Chunk {
  int job;
  int64_t rb0, rb1;
};

}  // namespace

// Independent GEMVs on Q4NX weights, each described by 5 int64 slots: w, x, y (addresses), n (rows), k.
extern "C" void gemv_q4nx_cpu_batch(const int64_t *desc, int count) {
  // Jobs that read the same activations (Q, K and V; gate and up; the LM head's partitions)
  // share one conversion of them.
  std::vector<Activations> acts;
  acts.reserve(count);
  std::vector<int> act_of(count);
  std::vector<Chunk> chunks;
  for (int i = 0; i < count; ++i) {
    const int64_t *d = desc + 5 * i;
    int same = -1;
    for (int j = 0; j < i && same < 0; ++j)
      if (desc[5 * j + 1] == d[1] && desc[5 * j + 4] == d[4]) same = act_of[j];
    if (same < 0) {
      same = static_cast<int>(acts.size());
      acts.emplace_back(reinterpret_cast<const uint16_t *>(d[1]), d[4]);
    }
    act_of[i] = same;
    const int64_t blocks = d[3] / kRows, bytes = d[4] * kBytesPerCol;
    int64_t step = kChunkBytes / bytes;
    step = step < 1 ? 1 : step;
    for (int64_t b = 0; b < blocks; b += step) chunks.push_back({i, b, b + step < blocks ? b + step : blocks});
  }
  const int64_t total = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < total; ++c) {
    const int64_t *d = desc + 5 * chunks[c].job;
    const uint8_t *w = reinterpret_cast<const uint8_t *>(d[0]);
    uint16_t *y = reinterpret_cast<uint16_t *>(d[2]);
    for (int64_t b = chunks[c].rb0; b < chunks[c].rb1; ++b)
      gemv_row_block(w + b * d[4] * kBytesPerCol, d[4], acts[act_of[chunks[c].job]], y + b * kRows);
  }
}
