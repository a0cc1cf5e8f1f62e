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
// Prefill's GEMM on the same contract (gemm_q4nx_int_cpu, below): each output row is what the
// GEMV computes for that activation row, to the bit. On AVX2 the float GEMM is bound by two
// 8-wide FMAs a cycle (16 multiply-adds); vpmaddubsw forms 32 byte products a cycle per pipe,
// twice the multiply-adds at two bytes per activation, four times at one. What makes it pay
// is reuse: each load of values is unpacked once for several rows of A, each activation row is
// converted once per call, and a task's rows of A and its row-block stay in the core's L2. The
// `avx512` class (Intel's cores, where vdpbf16ps is slow) runs it too, with vpdpbusd on one-byte
// activations: 2.6 times its FMA GEMM. `avx512bf16` keeps the dequantizing GEMM: with its wide
// activations vdpbf16ps already runs at vpdpbusd's rate on a Zen 5.

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "q4nx_blocks.h"
#include "stream_split.h"

namespace {

using q4nx::kBytesPerCol;
using q4nx::kGroup;
using q4nx::kNibbleBytes;
using q4nx::kRows;

// Groups g0..g1 of one row in decode's fixed point (q4nx::fixed_point), as the byte dot products
// read it: unit u's 4 bytes at xh[step u]; wide, those are the high bytes Xh of X = 256 Xh + Xl
// and the low bytes Xl go to xl[step u] (narrow: X itself at xh, nothing at xl).
void convert_groups(const uint16_t *x, int64_t g0, int64_t g1, int32_t *xh, int32_t *xl, int64_t step, float *unit,
                    float *sum) {
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

void convert_row_narrow(const uint16_t *x, int64_t k, int32_t *xb, float *unit, float *sum);   // below

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

// One row-block: 32 outputs over all K, read as one forward stream, asked for `ahead` bytes on.
void gemv_row_block(const uint8_t *rb, int64_t k, const int32_t *xh, const int32_t *xl, const float *unit,
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
  const int64_t n_pieces = static_cast<int64_t>(pieces.size());
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < n_pieces; ++p) acts[pieces[p].act].convert(pieces[p].g0, pieces[p].g1);
    // (the loop's barrier: every row-block below reads all of its activations)
    split.run([&](int job, int64_t b) {
      const int64_t *d = desc + 5 * job;
      const Activations &act = acts[act_of[job]];
      gemv_row_block(reinterpret_cast<const uint8_t *>(d[0]) + b * block_bytes[job], d[4], act.hi.data(),
                     act.lo.data(), act.unit.data(), act.sum.data(), reinterpret_cast<uint16_t *>(d[2]) + b * kRows, ahead);
    });
  }
}

// ---- GEMM on the decode contract --------------------------------------------------------------

namespace {

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
void convert_row_wide(const uint16_t *x, int64_t k, int32_t *hl, float *unit, float *sum) {
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
void convert_row_narrow(const uint16_t *x, int64_t k, int32_t *xb, float *unit, float *sum) {
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

void convert_row(const uint16_t *x, int64_t k, int32_t *words, float *unit, float *sum) {
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

// Rows first.. of A in decode's fixed point, converted once for every row-block to read, into a
// buffer that outlives the call: a prefill's GEMM would otherwise fault in fresh pages for it
// on every call (at 2048 x 8192, 36 MB, a tenth of the GEMM's time).
struct RowActivations {
  int64_t units, groups, first = 0;
  int32_t *hl = nullptr;                   // per row: convert_row's words, kActBytes per unit
  float *unit = nullptr, *sum = nullptr;   // [rows][groups]
  RowActivations(int64_t k, int64_t rows) : units(k / q4nx::kUnitCols), groups(k / kGroup) {
    static thread_local std::vector<int32_t> buf;
    const size_t need = static_cast<size_t>(rows * (units * q4nx::kActBytes + groups * 2));
    if (buf.size() < need) buf.resize(need);
    hl = buf.data();
    unit = reinterpret_cast<float *>(hl + rows * units * q4nx::kActBytes);
    sum = unit + rows * groups;
  }
  // Called by every thread of a team: rows r0..r1 of A become rows 0.. of the buffer.
  void convert(const uint16_t *a, int64_t k, int64_t r0, int64_t r1) {
#pragma omp single
    first = r0;
#pragma omp for schedule(static)
    for (int64_t r = r0; r < r1; ++r)
      convert_row(a + r * k, k, row(r), unit_row(r), sum_row(r));
  }
  int32_t *row(int64_t r) const { return hl + (r - first) * units * q4nx::kActBytes; }
  float *unit_row(int64_t r) const { return unit + (r - first) * groups; }
  float *sum_row(int64_t r) const { return sum + (r - first) * groups; }
};

// Rows r0.. r0 + R - 1 of a register tile: each one's activation words, units and sums.
template <int R>
struct TileRows {
  const int32_t *x[R];
  const float *unit[R], *sum[R];
  TileRows(const RowActivations &act, int64_t r0) {
    for (int i = 0; i < R; ++i) {
      x[i] = act.row(r0 + i);
      unit[i] = act.unit_row(r0 + i);
      sum[i] = act.sum_row(r0 + i);
    }
  }
};

#if NATIVE_AVX2

// Rows of A a register tile takes (int_tile below): as many as 8 sums a row set leave room for.
constexpr int kTileRows = q4nx::kActBytes == 1 ? 4 : 2;

// R rows of A against 16 rows of one row-block, over all K: rows 8 h .. 8 h + 7 (the low nibbles
// of the 32-byte half h of every unit) and the 8 rows 16 above them (the high nibbles).
//
// Registers (16 ymm): per row of A, 16-bit sums for 2 row sets times the activation's bytes
// (wide: Xh, Xl; narrow: X), so wide R = 2 takes 8 and narrow R = 4 takes 8, plus the two
// unpacked value vectors, the broadcast activation bytes and the products; each 32-byte load is
// unpacked once for all R rows. The f32 outputs are touched once a group.
//
// Saturation: vpmaddubsw adds two products of a value (at most 15) and a signed byte (at least
// -128), so each 16-bit lane is within 2 * 15 * 128 = 3840; a group adds kGroup / 4 = 8 of them
// per lane before widening, at most 30720 < 2^15, so nothing saturates or wraps (a ninth would).
//
// With AVX-VNNI (the `avxvnni` class, one-byte activations) the sums are vpdpbusd's 32-bit ones
// of the whole bytes and the high nibbles, as in group_f32_narrow: nothing to saturate, no
// widening, and the low-nibble mask gone. On the Xeon of docs/profile.md the GEMM ran at 0.40
// TFLOP/s against vpmaddubsw's 0.31, alike for 4, 5 or 6 rows of A.
template <int R>
void int_tile(const uint8_t *rb, int64_t k, int half, const RowActivations &act, int64_t r0, uint16_t *c,
              int64_t ldc) {
  static_assert(kGroup / q4nx::kUnitCols * 2 * 15 * 128 < 32768, "16-bit group sums would saturate");
  constexpr int B = q4nx::kActBytes;   // sums per row set, and int32 words per unit
  constexpr bool kVnni = NATIVE_AVXVNNI && B == 1;
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), x256 = _mm256_set1_epi16(256);
  const TileRows<R> t(act, r0);
  __m256 y[R][2];
  for (auto &v : y) v[0] = v[1] = _mm256_setzero_ps();
  const int64_t groups = k / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const q4nx::Group grp = q4nx::group(rb, g);
    const uint8_t *values = grp.values + 32 * half;
    const int64_t u0 = g * (kGroup / q4nx::kUnitCols);
    __m256i s[R][2 * B];   // [low, high nibbles][x Xh, x Xl (wide) | x X (narrow)]
    for (int i = 0; i < R; ++i)
      for (auto &v : s[i]) v = _mm256_setzero_si256();
    for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; ++u) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(values + u * q4nx::kUnitBytes));
      const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
      if constexpr (kVnni) {   // 32-bit sums of the whole bytes and the high nibbles (group_f32_narrow)
        for (int i = 0; i < R; ++i) {
          const __m256i xb = _mm256_set1_epi32(t.x[i][u0 + u]);
          s[i][0] = _mm256_dpbusd_avx_epi32(s[i][0], v, xb);
          s[i][1] = _mm256_dpbusd_avx_epi32(s[i][1], qh, xb);
        }
      } else {
        const __m256i q[2] = {_mm256_and_si256(v, nib), qh};
        for (int i = 0; i < R; ++i)
          for (int b = 0; b < B; ++b) {
            const __m256i xb = _mm256_set1_epi32(t.x[i][B * (u0 + u) + b]);
            for (int n = 0; n < 2; ++n)
              s[i][B * n + b] = _mm256_add_epi16(s[i][B * n + b], _mm256_maddubs_epi16(q[n], xb));
          }
      }
      // Each unit's sums stay in their registers: left alone, GCC unrolls the group and forms
      // every product before adding any, which spills them all.
      for (int i = 0; i < R; ++i)
        for (auto &v : s[i]) asm("" : "+x"(v));
    }
    // The GEMV's combination, lane for lane: (scale * u) * sum(q X) + min * sum, two FMAs.
    for (int j = 0; j < 2; ++j) {
      const int rows = 8 * half + 16 * j;
      const __m256 scale = native::widen8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(grp.scales + rows)));
      const __m256 mins = native::widen8(_mm_loadu_si128(reinterpret_cast<const __m128i *>(grp.mins + rows)));
      for (int i = 0; i < R; ++i) {
        const __m256i s32 = kVnni   ? (j == 0 ? _mm256_sub_epi32(s[i][0], _mm256_slli_epi32(s[i][1], 4)) : s[i][1])
                            : B == 2 ? _mm256_add_epi32(_mm256_madd_epi16(s[i][2 * j], x256),
                                                        _mm256_madd_epi16(s[i][2 * j + 1], ones))
                                     : _mm256_madd_epi16(s[i][j], ones);
        y[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(scale, _mm256_set1_ps(t.unit[i][g])), y[i][j]);
        y[i][j] = _mm256_fmadd_ps(mins, _mm256_set1_ps(t.sum[i][g]), y[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 2; ++j)
      _mm_storeu_si128(reinterpret_cast<__m128i *>(c + i * ldc + 8 * half + 16 * j), native::round_bf16(y[i][j]));
}

// Rows r0..r1 of A against one row-block (32 outputs), in two passes of 16.
void int_block(const uint8_t *rb, int64_t k, const RowActivations &act, int64_t r0, int64_t r1, uint16_t *c,
               int64_t ldc) {
  for (int half = 0; half < 2; ++half) {
    int64_t r = r0;
    for (; r + kTileRows <= r1; r += kTileRows) int_tile<kTileRows>(rb, k, half, act, r, c + r * ldc, ldc);
    for (; r < r1; ++r) int_tile<1>(rb, k, half, act, r, c + r * ldc, ldc);
  }
}

#elif Q4NX_ACT_BYTES == 1

// Rows of A a register tile takes (int_tile below): its 4 R accumulators and the vectors a unit
// needs fit the 32 zmm registers. On the Xeon (docs/profile.md, "Which CPU") 6 rows ran at
// 0.71-0.73 TFLOP/s, 4 at 0.69-0.70 and 8, which spill, at 0.67.
constexpr int kTileRows = 6;

// R rows of A against all 32 rows of one row-block, over all K: each 64-byte unit is loaded and
// its high nibbles taken once for all R rows, and each row's group sums are group_f32_narrow's
// (the whole bytes' and the high nibbles' dot products), combined into the f32 outputs in the
// GEMV's order once a group.
template <int R>
void int_tile(const uint8_t *rb, int64_t k, const RowActivations &act, int64_t r0, uint16_t *c, int64_t ldc) {
  const __m512i nib = _mm512_set1_epi8(15);
  const TileRows<R> t(act, r0);
  __m512 y[R][2];
  for (auto &v : y) v[0] = v[1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const q4nx::Group grp = q4nx::group(rb, g);
    const int32_t u0 = static_cast<int32_t>(g * (kGroup / q4nx::kUnitCols));
    __m512i s[R][2];   // [whole bytes, high nibbles]
    for (auto &v : s) v[0] = v[1] = _mm512_setzero_si512();
    for (int64_t u = 0; u < kGroup / q4nx::kUnitCols; ++u) {
      const __m512i v = _mm512_loadu_si512(grp.values + u * q4nx::kUnitBytes);
      const __m512i qh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      for (int i = 0; i < R; ++i) {
        const __m512i b = _mm512_set1_epi32(t.x[i][u0 + u]);
        s[i][0] = _mm512_dpbusd_epi32(s[i][0], v, b);
        s[i][1] = _mm512_dpbusd_epi32(s[i][1], qh, b);
      }
    }
    const native::F16 scale[2] = {native::load_bf16(grp.scales), native::load_bf16(grp.scales + native::kWidth)};
    const native::F16 mins[2] = {native::load_bf16(grp.mins), native::load_bf16(grp.mins + native::kWidth)};
    for (int i = 0; i < R; ++i) {
      const __m512 sums[2] = {_mm512_cvtepi32_ps(_mm512_sub_epi32(s[i][0], _mm512_slli_epi32(s[i][1], 4))),
                              _mm512_cvtepi32_ps(s[i][1])};
      const __m512 uu = _mm512_set1_ps(t.unit[i][g]), xs = _mm512_set1_ps(t.sum[i][g]);
      for (int j = 0; j < 2; ++j) y[i][j] = _mm512_fmadd_ps(sums[j], _mm512_mul_ps(scale[j].v, uu), y[i][j]);
      for (int j = 0; j < 2; ++j) y[i][j] = _mm512_fmadd_ps(mins[j].v, xs, y[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 2; ++j) native::store_bf16(c + i * ldc + j * native::kWidth, {y[i][j]});
}

// Rows r0..r1 of A against one row-block (32 outputs).
void int_block(const uint8_t *rb, int64_t k, const RowActivations &act, int64_t r0, int64_t r1, uint16_t *c,
               int64_t ldc) {
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows) int_tile<kTileRows>(rb, k, act, r, c + r * ldc, ldc);
  for (; r < r1; ++r) int_tile<1>(rb, k, act, r, c + r * ldc, ldc);
}

#else

constexpr int kTileRows = 2;

// AVX-512 with wide activations has no tile: each row of A through the GEMV's own row-block, so
// the bits are the GEMV's by construction. Slow (nothing is reused between rows): those classes'
// prefill keeps the dequantizing GEMM, and this serves the tests that hold every class to one
// contract.
void int_block(const uint8_t *rb, int64_t k, const RowActivations &act, int64_t r0, int64_t r1, uint16_t *c,
               int64_t ldc) {
  for (int64_t r = r0; r < r1; ++r)
    gemv_row_block(rb, k, act.row(r), act.row(r) + act.units, act.unit_row(r), act.sum_row(r), c + r * ldc,
                   native::stream_ahead());
}

#endif

// A task is one row-block against a block of rows of A whose fixed-point bytes (kActBytes K
// each) fill about half a core's 1 MiB L2 next to the row-block (20 K bytes): measured with
// two-byte activations on 2048 x 8192, 64 rows (1 MiB of them) ran 20 % slower than 16 or 32;
// on K = 2048 anything from 32 to 256 is alike. A block is whole register tiles.
constexpr int64_t kTaskActBytes = 512 * 1024;
// Rows converted at a time: the buffer stays a few MiB however long the prompt.
constexpr int64_t kConvertBytes = 4 * 1024 * 1024;

}  // namespace

// C[m][n] = A[m][k] · Wᵀ with W in Q4NX (device form), on decode's contract: row i is exactly what
// gemv_q4nx_cpu_batch computes for x = A[i] (the same fixed-point activations and exact integer
// group sums, combined in the same f32 order, rounded to bf16 once), so a prefill on this
// kernel and a decode step agree to the bit on the same row. Tasks of (row-block, block of rows)
// are scheduled dynamically over the team; each row of A is converted once per call.
extern "C" void gemm_q4nx_int_cpu(const uint16_t *a, const uint8_t *w, uint16_t *c, int64_t m, int64_t n, int64_t k) {
  const int64_t blocks = n / kRows, rb_bytes = k * kBytesPerCol;
  const int64_t row_bytes = q4nx::kActBytes * k;
  int64_t mb = kTaskActBytes / row_bytes / kTileRows * kTileRows;
  mb = mb < kTileRows ? kTileRows : mb;
  int64_t rows = kConvertBytes / row_bytes / mb * mb;
  rows = rows < mb ? mb : rows;
  rows = rows > m ? m : rows;
  RowActivations act(k, rows);
#pragma omp parallel
  for (int64_t s0 = 0; s0 < m; s0 += rows) {
    const int64_t s1 = s0 + rows < m ? s0 + rows : m, mblocks = (s1 - s0 + mb - 1) / mb;
    act.convert(a, k, s0, s1);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < blocks * mblocks; ++t) {
      const int64_t b = t % blocks, r0 = s0 + t / blocks * mb, r1 = r0 + mb < s1 ? r0 + mb : s1;
      int_block(w + b * rb_bytes, k, act, r0, r1, c + b * kRows, n);
    }
  }
}
