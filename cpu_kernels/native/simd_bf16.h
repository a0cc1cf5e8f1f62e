// The vector vocabulary the native kernels are written in, one definition per ISA class.
//
// Every kernel source is compiled once per ISA class (native_cpu.py picks the library at run
// time), so the kernels say what they compute in 16-float vectors and this header says how:
//   - AVX512-BF16 (-mavx512bf16): one __m512; bf16 pair dot products by vdpbf16ps.
//   - AVX-512 without it (the `avx512` class): one __m512; a pair dot product as two FMAs on
//     activations widened to f32 once per call (bcast_f32 below). On the Xeon of
//     docs/profile.md, "CPU classes", vdpbf16ps issued at a quarter of vfmadd231ps's rate and
//     does two of its multiply-adds, so the FMAs ran the GEMM 1.5 times as fast
//     (native_cpu._faster_dot times the two on each CPU that has both).
//   - AVX2 + FMA (no AVX-512 at all): two __m256; a bf16 pair widened to f32 in registers by a
//     shift (the even element) and a mask (the odd one), then two FMAs.
//   - AVX2 with AVX-VNNI (the `avxvnni` class: Intel's cores from Alder Lake on, which have no
//     AVX-512): the AVX2 vocabulary; only the Q4NX kernels' byte products change (q4nx_cpu.cc, q4nx_gemm_cpu.cc).
// Both ISAs round the same way wherever the operation order is fixed here: the tail masks,
// the nearest-even store, e^x and the reduction trees give the same bits on either path. The
// pair dot step adds the odd product before the even one, as the AVX512-BF16 instruction is
// specified to; it differs from it only where that instruction flushes subnormals.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define NATIVE_AVX512 1
#define NATIVE_AVXVNNI 0
#if defined(__AVX512BF16__)
#define NATIVE_DOT_FMA 0
#else
#define NATIVE_DOT_FMA 1   // pair dot products by FMAs on activations widened once (bcast_f32)
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define NATIVE_AVX2 1
#define NATIVE_DOT_FMA 0   // FMAs too, but on pairs widened in registers: no bcast_f32
#if defined(__AVXVNNI__)
#define NATIVE_AVXVNNI 1   // vpdpbusd on 256-bit vectors
#else
#define NATIVE_AVXVNNI 0
#endif
#else
#error "native kernels need AVX-512 (F, BW, VL, VNNI) or AVX2 with FMA"
#endif

namespace native {

constexpr int kWidth = 16;   // floats per vector: outputs of one weight tile block

// How decode's GEMVs ask for their weights ahead (stream_ahead_cpu.cc): how many bytes on, and
// with which hint: non-temporal (NTA), into every cache level (T0), or into the second level and
// beyond (T1). The values are the hints' locality as __builtin_prefetch numbers it.
enum class Hint : int { kNta = 0, kT1 = 2, kT0 = 3 };
struct Ahead {
  int64_t bytes;
  Hint hint;
};
Ahead stream_ahead();

// Asks for the cache lines of [p, p + bytes) moved `ahead.bytes` on: decode's GEMVs ask for the
// weight stream they walk ahead of their reads (the hardware prefetchers alone left a token's
// GEMVs 6-10 % slower; docs/profile.md, "Asking for the weights ahead"). Non-temporal where the
// CPU's NTA prefetch keeps pace (each weight byte is read once a token, and what the host runs
// between the GEMVs keeps more of the caches); T1 where it does not (stream_ahead_cpu.cc). The
// address may lie past the end of the weights, so it is formed as an integer: a prefetch never
// faults. (Stopping at the end of a job's weights instead cost 1-1.6 %.)
// (The hint is chosen per line: GCC 12 dropped the prefetches of a loop per hint.)
inline void prefetch_ahead(const void *p, int64_t bytes, Ahead ahead) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p) + ahead.bytes;
  for (int64_t line = 0; line < bytes; line += 64) {
    const char *q = reinterpret_cast<const char *>(at + line);
    if (ahead.hint == Hint::kT1) _mm_prefetch(q, _MM_HINT_T1);
    else if (ahead.hint == Hint::kT0) _mm_prefetch(q, _MM_HINT_T0);
    else _mm_prefetch(q, _MM_HINT_NTA);
  }
}

// 8 bf16 as f32: every class has AVX2, and the row conversions of the Q4NX kernels use it.
inline __m256 widen8(__m128i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)); }

#if NATIVE_AVX512

struct F16 { __m512 v; };      // 16 floats
struct M16 { __mmask16 m; };   // 16 lane flags
struct P16 { __m512i v; };     // 16 bf16 pairs as stored: a tile vector
#if NATIVE_DOT_FMA
constexpr const char *kVectorIsa = "avx512";
struct W16 { __m512 even, odd; };   // a tile vector ready for dot(): each pair's halves as f32
struct X2 { __m512 even, odd; };    // one bf16 pair of the activation, in every lane, as f32
#else
constexpr const char *kVectorIsa = "avx512bf16";
struct W16 { __m512bh v; };    // a tile vector ready for dot()
struct X2 { __m512bh v; };     // one bf16 pair of the activation, in every lane
#endif

inline bool cpu_has_vector_isa() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         (NATIVE_DOT_FMA || __builtin_cpu_supports("avx512bf16"));
}

inline F16 zero() { return {_mm512_setzero_ps()}; }
inline F16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F16 add(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 sub(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 mul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 div(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 min(F16 a, F16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }      // a b + c
inline F16 fnma(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }    // c - a b
inline F16 round_even(F16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }

// Lanes [0, n) set; n may be negative or past 16.
inline M16 lanes_below(int64_t n) {
  return {n >= kWidth ? static_cast<__mmask16>(0xffff) : n <= 0 ? static_cast<__mmask16>(0)
                                                                : static_cast<__mmask16>((1u << n) - 1)};
}
inline F16 keep(M16 m, F16 a) { return {_mm512_maskz_mov_ps(m.m, a.v)}; }
// Whether any lane of a is >= the same lane of b (NaN in either never is, as in scalar >=).
inline bool any_at_least(F16 a, F16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ) != 0; }
inline F16 max_where(F16 a, M16 m, F16 b) { return {_mm512_mask_max_ps(a.v, m.m, a.v, b.v)}; }

// The first `left` values (all 16 if left >= 16); the rest read as 0 and are not touched.
inline F16 load_f32(const float *p, int64_t left = kWidth) {
  return left >= kWidth ? F16{_mm512_loadu_ps(p)} : F16{_mm512_maskz_loadu_ps(lanes_below(left).m, p)};
}
inline void store_f32(float *p, F16 a, int64_t left = kWidth) {
  if (left >= kWidth) _mm512_storeu_ps(p, a.v);
  else _mm512_mask_storeu_ps(p, lanes_below(left).m, a.v);
}
inline __m512 widen16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
inline F16 load_bf16(const uint16_t *p, int64_t left = kWidth) {
  return {widen16(left >= kWidth ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))
                                 : _mm256_maskz_loadu_epi16(lanes_below(left).m, p))};
}

// Round to nearest even, NaN kept quiet: the same bits as the scalar rounding torch uses.
inline void store_bf16(uint16_t *p, F16 a, int64_t left = kWidth) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(p, lanes_below(left).m, _mm512_cvtepi32_epi16(r));
}

// a rounded to bf16 (nearest even) and widened back, in registers: store_bf16 then load_bf16's
// bits for every a that is not NaN (what exp_ps returns, say); a NaN may come out as another
// value. No NaN test: in a loop of a few operations (the probabilities of an online softmax),
// store_bf16's quieting took about 6 % of the attention on AVX2.
inline F16 bf16_rounded(F16 a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                               _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}

// 2^n a for integral n, one rounding.
inline F16 scale2(F16 a, F16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }

// The reductions' tree (halves, then quarters, then pairs) is spelled out so that the AVX2
// path adds in the same order.
inline float reduce_add(F16 a) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
inline float reduce_max(F16 a) {
  const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  const __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(p, _mm_movehdup_ps(p)));
}
// Lane j is reduce_add(s[j]), bit for bit: the same tree for sixteen vectors at once, with the
// halves, quarters and pairs of different vectors side by side, so each sum costs about three
// instructions instead of seven.
inline F16 reduce_add16(const F16 *s) {
  __m512 h[8], q[4], p[2];
  for (int m = 0; m < 8; ++m)   // halves: vectors 2m, 2m + 1 in lanes 0-7, 8-15
    h[m] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * m].v, s[2 * m + 1].v, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(s[2 * m].v, s[2 * m + 1].v, _MM_SHUFFLE(3, 2, 3, 2)));
  for (int c = 0; c < 4; ++c)   // quarters: vector 4c + k in 128-bit lane k
    q[c] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * c], h[2 * c + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(h[2 * c], h[2 * c + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int c = 0; c < 2; ++c)   // pairs: lane k holds vectors 8c + k and 8c + 4 + k
    p[c] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * c], q[2 * c + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(q[2 * c], q[2 * c + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Element 4k + m of t is vector k + 4m's sum.
  return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t)};
}

inline P16 load_pairs(const void *p) { return {_mm512_loadu_si512(p)}; }
inline void store_pairs(void *p, P16 a) { _mm512_storeu_si512(p, a.v); }
// The even and the odd element of each pair, as f32.
inline F16 evens(P16 a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(a.v, 16))}; }
inline F16 odds(P16 a) { return {_mm512_castsi512_ps(_mm512_and_si512(a.v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))}; }
#if NATIVE_DOT_FMA
inline W16 widen(P16 a) { return {evens(a).v, odds(a).v}; }
inline X2 bcast_pair(uint32_t pair) {
  const P16 b{_mm512_set1_epi32(static_cast<int>(pair))};
  return {evens(b).v, odds(b).v};
}
// A pair already widened to two floats (a_f32): two broadcasts from memory, no arithmetic.
inline X2 bcast_f32(const float *pair) { return {_mm512_set1_ps(pair[0]), _mm512_set1_ps(pair[1])}; }
// Each bf16 product is exact in f32, so an FMA per element rounds as vdpbf16ps's two adds do.
inline F16 dot(F16 acc, W16 w, X2 x) {
  return {_mm512_fmadd_ps(w.even, x.even, _mm512_fmadd_ps(w.odd, x.odd, acc.v))};
}
#else
inline W16 widen(P16 a) { return {(__m512bh)a.v}; }
inline X2 bcast_pair(uint32_t pair) { return {(__m512bh)_mm512_set1_epi32(static_cast<int>(pair))}; }
// acc[i] += w[i].odd x.odd + w[i].even x.even
inline F16 dot(F16 acc, W16 w, X2 x) { return {_mm512_dpbf16_ps(acc.v, w.v, x.v)}; }
#endif

#else  // NATIVE_AVX2

constexpr const char *kVectorIsa = NATIVE_AVXVNNI ? "avxvnni" : "avx2";

struct F16 { __m256 lo, hi; };
struct M16 { __m256 lo, hi; };      // all-ones lanes
struct P16 { __m256i lo, hi; };     // pairs 0-7, 8-15
struct W16 { __m256 even_lo, odd_lo, even_hi, odd_hi; };
struct X2 { __m256 even, odd; };

inline bool cpu_has_vector_isa() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         (!NATIVE_AVXVNNI || __builtin_cpu_supports("avxvnni"));
}

inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 add(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 sub(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 mul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 div(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F16 max(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 min(F16 a, F16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fnma(F16 a, F16 b, F16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 round_even(F16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}

inline M16 lanes_below(int64_t n) {
  const int32_t c = n >= kWidth ? kWidth : n <= 0 ? 0 : static_cast<int32_t>(n);
  const __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cv = _mm256_set1_epi32(c);
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(cv, at)),
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(cv, _mm256_add_epi32(at, _mm256_set1_epi32(8))))};
}
inline F16 keep(M16 m, F16 a) { return {_mm256_and_ps(m.lo, a.lo), _mm256_and_ps(m.hi, a.hi)}; }
inline bool any_at_least(F16 a, F16 b) {
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ))) != 0;
}
// max(a, b) where m is set, else a; with vmaxps's operand rule (b if either is NaN), as the masked AVX-512 max.
inline F16 max_where(F16 a, M16 m, F16 b) {
  return {_mm256_blendv_ps(a.lo, _mm256_max_ps(a.lo, b.lo), m.lo), _mm256_blendv_ps(a.hi, _mm256_max_ps(a.hi, b.hi), m.hi)};
}

inline F16 load_f32(const float *p, int64_t left = kWidth) {
  if (left >= kWidth) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  alignas(32) float t[kWidth] = {};
  if (left > 0) std::memcpy(t, p, left * sizeof(float));
  return {_mm256_load_ps(t), _mm256_load_ps(t + 8)};
}
inline void store_f32(float *p, F16 a, int64_t left = kWidth) {
  if (left >= kWidth) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
    return;
  }
  alignas(32) float t[kWidth];
  _mm256_store_ps(t, a.lo);
  _mm256_store_ps(t + 8, a.hi);
  if (left > 0) std::memcpy(p, t, left * sizeof(float));
}
inline F16 load_bf16(const uint16_t *p, int64_t left = kWidth) {
  if (left >= kWidth) {
    // One load, its middle quarters swapped, then each 128-bit lane's words under zeros: three
    // shuffles where two widenings and two shifts took four, and none on the ports the integer
    // products use (the Q4NX GEMV reads two scale and two min vectors a group this way).
    const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)), 0xd8);
    const __m256i zero = _mm256_setzero_si256();
    return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v))};
  }
  alignas(32) uint16_t t[kWidth] = {};
  if (left > 0) std::memcpy(t, p, left * sizeof(uint16_t));
  return {widen8(_mm_load_si128(reinterpret_cast<const __m128i *>(t))),
          widen8(_mm_load_si128(reinterpret_cast<const __m128i *>(t + 8)))};
}

inline __m128i round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i bits = _mm256_blendv_epi8(r, quiet, nan);   // each lane < 2^16: packs without saturating
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
}
inline void store_bf16(uint16_t *p, F16 a, int64_t left = kWidth) {
  const __m128i lo = round_bf16(a.lo), hi = round_bf16(a.hi);
  if (left >= kWidth) {
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p + 8), hi);
    return;
  }
  alignas(16) uint16_t t[kWidth];
  _mm_store_si128(reinterpret_cast<__m128i *>(t), lo);
  _mm_store_si128(reinterpret_cast<__m128i *>(t + 8), hi);
  if (left > 0) std::memcpy(p, t, left * sizeof(uint16_t));
}

// As the AVX-512 bf16_rounded: store_bf16 then load_bf16's bits where a is not NaN.
inline __m256 bf16_rounded8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                              _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline F16 bf16_rounded(F16 a) { return {bf16_rounded8(a.lo), bf16_rounded8(a.hi)}; }

// 2^n a for integral n in [-300, 300], one rounding: two exact power-of-two factors, each
// within the normal range, make the same result as vscalefps.
inline __m256 pow2(__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); }
inline __m256 scale2_8(__m256 a, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(a, pow2(h)), pow2(_mm256_sub_epi32(ni, h)));
}
inline F16 scale2(F16 a, F16 n) { return {scale2_8(a.lo, n.lo), scale2_8(a.hi, n.hi)}; }

inline float reduce_add(F16 a) {
  const __m256 h = _mm256_add_ps(a.lo, a.hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
inline float reduce_max(F16 a) {
  const __m256 h = _mm256_max_ps(a.lo, a.hi);
  const __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(p, _mm_movehdup_ps(p)));
}

// Lane j is reduce_add(s[j]), bit for bit (as the AVX-512 version).
inline F16 reduce_add16(const F16 *s) {
  __m256 h[16], q[8], p[4], out[2];
  for (int j = 0; j < 16; ++j) h[j] = _mm256_add_ps(s[j].lo, s[j].hi);
  for (int m = 0; m < 8; ++m)   // quarters: vector 2m in the low 128 bits, 2m + 1 in the high
    q[m] = _mm256_add_ps(_mm256_permute2f128_ps(h[2 * m], h[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(h[2 * m], h[2 * m + 1], 0x31));
  for (int c = 0; c < 4; ++c)   // pairs: vectors 4c, 4c + 2 low; 4c + 1, 4c + 3 high
    p[c] = _mm256_add_ps(_mm256_shuffle_ps(q[2 * c], q[2 * c + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(q[2 * c], q[2 * c + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int e = 0; e < 2; ++e) {   // even vectors of 8e..8e + 7 low, odd ones high, then in order
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(p[2 * e], p[2 * e + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(p[2 * e], p[2 * e + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    out[e] = _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  return {out[0], out[1]};
}

inline P16 load_pairs(const void *p) {
  const __m256i *v = reinterpret_cast<const __m256i *>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
inline void store_pairs(void *p, P16 a) {
  __m256i *v = reinterpret_cast<__m256i *>(p);
  _mm256_storeu_si256(v, a.lo);
  _mm256_storeu_si256(v + 1, a.hi);
}
// A bf16 is the top half of its f32: the even element of a pair moves up, the odd one is masked.
inline __m256 even_f32(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_f32(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline W16 widen(P16 a) { return {even_f32(a.lo), odd_f32(a.lo), even_f32(a.hi), odd_f32(a.hi)}; }
inline X2 bcast_pair(uint32_t pair) {
  const __m256i b = _mm256_set1_epi32(static_cast<int>(pair));
  return {even_f32(b), odd_f32(b)};
}
// Each bf16 product is exact in f32, so an FMA per element rounds as vdpbf16ps's two adds do.
inline F16 dot(F16 acc, W16 w, X2 x) {
  return {_mm256_fmadd_ps(w.even_lo, x.even, _mm256_fmadd_ps(w.odd_lo, x.odd, acc.lo)),
          _mm256_fmadd_ps(w.even_hi, x.even, _mm256_fmadd_ps(w.odd_hi, x.odd, acc.hi))};
}
inline F16 evens(P16 a) { return {even_f32(a.lo), even_f32(a.hi)}; }
inline F16 odds(P16 a) { return {odd_f32(a.lo), odd_f32(a.hi)}; }

#endif

// e^x: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r, scaled by 2^n. Within
// 2 ulp of expf; overflows to inf and underflows to 0 like expf.
inline F16 exp_ps(F16 x) {
  x = max(min(x, set1(100.0f)), set1(-104.0f));
  const F16 n = round_even(mul(x, set1(1.44269504088896341f)));
  F16 r = fnma(n, set1(0.693359375f), x);
  r = fnma(n, set1(-2.12194440e-4f), r);
  F16 p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  p = fma(mul(p, r), r, add(r, set1(1.0f)));
  return scale2(p, n);
}

}  // namespace native
