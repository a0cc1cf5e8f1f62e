// Decode's GEMV on Q4NX weights in the simulated device's form (q4nx_blocks.h), with
// dequantization folded into the sums as the NPU's fused kernel folds it: per group of 32
// columns and per row,
//     y += (scale * u) * sum(q * X) + min * sum(x),
// X the activations as 14-bit integers in units of u (q4nx.fixed_point; on the classes that take
// them narrow, signed bytes, and sum(x) is u * sum(X): q4nx.group_sums). sum(q * X) is an exact
// integer, so it comes out the same on every ISA class of one width and in torch.
//
// The device form puts one row's values for 4 columns in each 32-bit lane, and X = 256 Xh + Xl
// splits into two signed bytes (wide; narrow X is one byte), so the sums are byte dot products:
// unsigned values times signed activation bytes, 4 per lane (vpdpbusd with AVX512-VNNI, and on
// 256-bit vectors with AVX-VNNI; vpmaddubsw into 16-bit sums on AVX2, widened once a group). A
// 64-byte unit (128 weights, both halves of 16 rows) costs one load, a mask, a shift and four
// dot products wide, two narrow (with vpdpbusd the mask goes too: below). With f32 FMAs (as
// the bf16 GEMV uses) or with 16-bit products the arithmetic, not memory, would set the token
// rate on a 2-core CPU; on AVX2 and on Intel's AVX-512 cores even the wide byte products held it
// back, which is why those classes take their activations narrow
// (native_build.Q4NX_NARROW_ACTIVATIONS).
//
// Prefill's GEMM on the same contract is in q4nx_gemm_cpu.cc; both convert activations with
// q4nx_activations.h.

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "q4nx_activations.h"
#include "q4nx_blocks.h"
#include "replayed.h"
#include "stream_split.h"

namespace {

using q4nx::kBytesPerCol;
using q4nx::kGroup;
using q4nx::kRows;
using q4nx::convert_groups;
using q4nx::convert_row_narrow;

struct Activations {
  const uint16_t *x;
  std::vector<int32_t> hi, lo;   // per 4 columns: the bytes Xh, Xl of X = 256 Xh + Xl (narrow: X in hi)
  std::vector<float> unit, sum;
  Activations(const uint16_t *x, int64_t k)
      : x(x), hi(k / 4), lo(q4nx::kActBytes == 2 ? k / 4 : 0), unit(k / kGroup), sum(k / kGroup) {}
  void convert(int64_t g0, int64_t g1) {
    // Narrow, the GEMM's vectorized conversion (the same numbers; tests/test_q4nx.py reads
    // them back out of the GEMV): in scalar code a down projection's 8192 columns took most of
    // a small call on a Zen 3.
    if (q4nx::kActBytes == 1) {
      convert_row_narrow(x + g0 * kGroup, (g1 - g0) * kGroup, hi.data() + g0 * kGroup / q4nx::kUnitCols,
                         unit.data() + g0, sum.data() + g0);
      return;
    }
    convert_groups(x, g0, g1, hi.data(), lo.data(), 1, unit.data(), sum.data());
  }
};

#if NATIVE_AVX512

// The integer sums of one group for rows 0-15 (lo) and 16-31 (hi). A byte v of a unit is
// q_lo + 16 q_hi, so the low nibbles' sums are dot(v) - 16 dot(q_hi): the bytes go into the
// dot products as loaded, and only the high nibbles need a shift and a mask (one vector
// operation fewer per unit; 2 % in L2 on the Xeon, where the dot products were the cost).
// Two sets of accumulators take alternate units, to cover the dot product's latency.
inline void group_sums(const uint8_t *values, const int32_t *xh, const int32_t *xl, __m512i &lo, __m512i &hi) {
  const __m512i nib = _mm512_set1_epi8(15);
  __m512i a[8];
  for (auto &v : a) v = _mm512_setzero_si512();
  for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; u += 2) {
    for (int64_t s = 0; s < 2; ++s) {
      const __m512i v = _mm512_loadu_si512(values + (u + s) * q4nx::kUnitBytes);
      const __m512i qh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      const __m512i h = _mm512_set1_epi32(xh[u + s]), l = _mm512_set1_epi32(xl[u + s]);
      a[4 * s + 0] = _mm512_dpbusd_epi32(a[4 * s + 0], v, h);
      a[4 * s + 1] = _mm512_dpbusd_epi32(a[4 * s + 1], v, l);
      a[4 * s + 2] = _mm512_dpbusd_epi32(a[4 * s + 2], qh, h);
      a[4 * s + 3] = _mm512_dpbusd_epi32(a[4 * s + 3], qh, l);
    }
  }
  const __m512i both = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a[0], a[4]), 8), _mm512_add_epi32(a[1], a[5]));
  hi = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a[2], a[6]), 8), _mm512_add_epi32(a[3], a[7]));
  lo = _mm512_sub_epi32(both, _mm512_slli_epi32(hi, 4));
}

inline void group_f32(const uint8_t *values, const int32_t *xh, const int32_t *xl, native::F16 &lo, native::F16 &hi) {
  __m512i il, ih;
  group_sums(values, xh, xl, il, ih);
  lo = {_mm512_cvtepi32_ps(il)};
  hi = {_mm512_cvtepi32_ps(ih)};
}

// Narrow (one byte, the classes in native_build.Q4NX_NARROW_ACTIVATIONS): two dot products per
// unit, not four, by the same identity.
inline void group_f32_narrow(const uint8_t *values, const int32_t *xb, native::F16 &lo, native::F16 &hi) {
  const __m512i nib = _mm512_set1_epi8(15);
  __m512i a[4];   // [unit parity][whole bytes, high nibbles]
  for (auto &v : a) v = _mm512_setzero_si512();
  for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; u += 2) {
    for (int64_t p = 0; p < 2; ++p) {
      const __m512i v = _mm512_loadu_si512(values + (u + p) * q4nx::kUnitBytes);
      const __m512i qh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      const __m512i b = _mm512_set1_epi32(xb[u + p]);
      a[2 * p] = _mm512_dpbusd_epi32(a[2 * p], v, b);
      a[2 * p + 1] = _mm512_dpbusd_epi32(a[2 * p + 1], qh, b);
    }
  }
  const __m512i h = _mm512_add_epi32(a[1], a[3]);
  lo = {_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(a[0], a[2]), _mm512_slli_epi32(h, 4)))};
  hi = {_mm512_cvtepi32_ps(h)};
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

// Narrow activations (one byte, q4nx.NARROW): two dot products per 32-byte load, not four.
//   - AVX2: vpmaddubsw into 16-bit sums of the low and the high nibbles, widened once a group.
//     One set of accumulators: the chain through each is a one-cycle add, and vpmaddubsw's
//     latency is off it (a second set, taking alternate units, cost four adds a group and
//     gained nothing).
//   - AVX-VNNI: vpdpbusd adds four byte products into each 32-bit lane without saturating, so
//     as on AVX-512 the bytes go in as loaded and the low nibbles' sums are dot(v) -
//     16 dot(q_hi): a shift, a mask and two dot products per 32 bytes, where AVX2 takes seven
//     operations. Two sets of accumulators take alternate units, to cover the dot product's
//     latency.
inline void group_f32_narrow(const uint8_t *values, const int32_t *xb, native::F16 &lo, native::F16 &hi) {
  const __m256i nib = _mm256_set1_epi8(15);
  __m256i a[8];   // [unit parity (AVX-VNNI only)][rows 0-7 | 8-15][low nibbles (AVX-VNNI: whole bytes), high]
  for (auto &v : a) v = _mm256_setzero_si256();
  for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; u += 2) {
    for (int64_t p = 0; p < 2; ++p) {
      const __m256i b = _mm256_set1_epi32(xb[u + p]);
      for (int64_t r = 0; r < 2; ++r) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(values + (u + p) * q4nx::kUnitBytes + 32 * r));
        const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
#if NATIVE_AVXVNNI
        a[4 * p + 2 * r] = _mm256_dpbusd_avx_epi32(a[4 * p + 2 * r], v, b);
        a[4 * p + 2 * r + 1] = _mm256_dpbusd_avx_epi32(a[4 * p + 2 * r + 1], qh, b);
#else
        a[2 * r] = _mm256_add_epi16(a[2 * r], _mm256_maddubs_epi16(_mm256_and_si256(v, nib), b));
        a[2 * r + 1] = _mm256_add_epi16(a[2 * r + 1], _mm256_maddubs_epi16(qh, b));
#endif
      }
    }
#if !NATIVE_AVXVNNI
    // Left alone, GCC unrolls the group, forms every product before adding any and spills them.
    for (int i = 0; i < 4; ++i) asm("" : "+x"(a[i]));
#endif
  }
  __m256 l[2], h[2];
  for (int r = 0; r < 2; ++r) {
#if NATIVE_AVXVNNI
    const __m256i high = _mm256_add_epi32(a[2 * r + 1], a[4 + 2 * r + 1]);
    l[r] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(a[2 * r], a[4 + 2 * r]), _mm256_slli_epi32(high, 4)));
    h[r] = _mm256_cvtepi32_ps(high);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    l[r] = _mm256_cvtepi32_ps(_mm256_madd_epi16(a[2 * r], ones));
    h[r] = _mm256_cvtepi32_ps(_mm256_madd_epi16(a[2 * r + 1], ones));
#endif
  }
  lo = {l[0], l[1]};
  hi = {h[0], h[1]};
}

#endif

}  // namespace

// One row-block, read as one forward stream, asked for `ahead` bytes on. Defined by its qualified
// name, so a definition that drifts from q4nx_activations.h's declaration does not compile.
void q4nx::gemv_row_block(const uint8_t *rb, int64_t k, const int32_t *xh, const int32_t *xl, const float *unit,
                          const float *sum, uint16_t *y, native::Ahead ahead) {
  native::F16 y_lo = native::zero(), y_hi = native::zero();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const q4nx::Group grp = q4nx::group(rb, g);
    native::prefetch_ahead(grp.values, q4nx::kGroupBytes, ahead);
    const int64_t unit0 = g * kGroup / q4nx::kUnitCols;
    native::F16 s_lo, s_hi;
    if (q4nx::kActBytes == 1)
      group_f32_narrow(grp.values, xh + unit0, s_lo, s_hi);
    else
      group_f32(grp.values, xh + unit0, xl + unit0, s_lo, s_hi);
    const native::F16 u = native::set1(unit[g]), xs = native::set1(sum[g]);
    y_lo = native::fma(s_lo, native::mul(native::load_bf16(grp.scales), u), y_lo);
    y_hi = native::fma(s_hi, native::mul(native::load_bf16(grp.scales + native::kWidth), u), y_hi);
    y_lo = native::fma(native::load_bf16(grp.mins), xs, y_lo);
    y_hi = native::fma(native::load_bf16(grp.mins + native::kWidth), xs, y_hi);
  }
  native::store_bf16(y, y_lo);
  native::store_bf16(y + native::kWidth, y_hi);
}

namespace {

// Groups of activations a thread converts at a time (1024 columns).
constexpr int64_t kConvertGroups = 32;

struct Piece {
  int act;
  int64_t g0, g1;
};

}  // namespace

// Independent GEMVs on Q4NX weights, each described by 5 int64 slots: w, x, y (addresses), n (rows), k.
extern "C" void gemv_q4nx_cpu_batch(const int64_t *desc, int count) {
  // Jobs that read the same activations (Q, K and V; gate and up; the LM head's partitions)
  // share one conversion of them.
  std::vector<Activations> acts;
  acts.reserve(count);
  std::vector<int> act_of(count);
  std::vector<int64_t> blocks(count), block_bytes(count);
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
    blocks[i] = d[3] / kRows;
    block_bytes[i] = d[4] * kBytesPerCol;
  }
  native::StreamSplit split(blocks, block_bytes);
  const native::Ahead ahead = native::stream_ahead();
  // The conversion is shared by the team too: on one thread a down projection's 8192 columns
  // took about 20 µs of each call while the other thread waited.
  std::vector<Piece> pieces;
  for (int a = 0; a < static_cast<int>(acts.size()); ++a) {
    const int64_t groups = static_cast<int64_t>(acts[a].unit.size());
    for (int64_t g = 0; g < groups; g += kConvertGroups)
      pieces.push_back({a, g, g + kConvertGroups < groups ? g + kConvertGroups : groups});
  }
  native::Pieces converting(static_cast<int64_t>(pieces.size()));
#pragma omp parallel
  {
    native::hold_if_asked(converting, split);
    converting.run([&](int64_t p) { acts[pieces[p].act].convert(pieces[p].g0, pieces[p].g1); });
    converting.wait();   // every row-block below reads all of its activations
    split.run([&](int job, int64_t b) {
      const int64_t *d = desc + 5 * job;
      const Activations &act = acts[act_of[job]];
      q4nx::gemv_row_block(reinterpret_cast<const uint8_t *>(d[0]) + b * block_bytes[job], d[4], act.hi.data(),
                           act.lo.data(), act.unit.data(), act.sum.data(),
                           reinterpret_cast<uint16_t *>(d[2]) + b * kRows, ahead);
    });
  }
}
