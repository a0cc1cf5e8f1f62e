// The resident KV cache's launches (npu_runtime/sim/ops.py's kv_append, decode_attn and
// attn_merge, whose torch bodies are the contract): a chunk's K/V rows appended to the
// head-major cache, one token's split-K attention over its live positions, and the merge of each
// KV head's splits.
//
// A decode token's calls are bound once and replayed (native_program.py), so the one thing that
// changes between tokens, the position, is read when the kernel runs, from the i32 the launch
// reads (`*start`, `*pos`): that is how the live length reaches the kernel. A position outside
// the cache is refused before anything is read or written, and the call's `*status` says so
// (1; 0 after a call that ran), which the Python side raises on (native_cpu.CheckedCall).
//
// decode_attn: KV head g's split s streams chunks s, s + splits, ... of positions 0..pos in that
// order with an online softmax, as the NPU's cores do: f32 scores scaled by 1/sqrt(d), the
// running max, probabilities e^(score - max) rounded to bf16 and summed as rounded, the f32
// accumulator and total rescaled by e^(old max - new max) at each chunk. Positions past `pos`
// in the last chunk are not read: their masked scores would add exact zeros. A split with no
// chunk leaves max = the mask fill, total 0 and a zero accumulator.
//
// The (KV head, split) items are shared by the OpenMP team, which at long contexts keeps every
// core reading: each thread takes a contiguous run of them and walks each of its heads' chunks
// in order, moving each chunk's split on (head_pass), so memory is read as one forward stream.
// An item's sums run in one order whoever computes them: every team gives the same bits. The
// query heads of a KV head go through each chunk together, up to kHeads at a time, scores
// sixteen positions at a time through one batched horizontal sum (as the host attention,
// attention_bf16_cpu.cc). Head dims of whole 32-dim blocks (64, 128) are multiplied in bf16
// pairs (pair_step): vdpbf16ps on AVX512-BF16, its two FMAs in its order elsewhere, so every
// class gives the same bits here too (as test_isa.py holds them), the instruction's flushing of
// subnormal operands aside.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "replayed.h"
#include "simd_bf16.h"

namespace {

namespace nv = native;
constexpr int64_t kW = nv::kWidth;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlocks = kMaxHeadDim / kW;
constexpr int kHeads = 4;                // query heads per pass over a chunk
constexpr float kMaskFill = -1.0e30f;    // ops.MASK_FILL: a split's max before its first chunk
// K elements read (positions x head dim x KV heads) above which the team splits the items, as
// the host attention's: in decode the team is awake from the GEMVs just before.
constexpr int64_t kParallelAbove = 1 << 12;
// Elements appended (rows x KV heads x head dim) above which the team shares the copy: a
// prefill chunk's rows, never a decode token's.
constexpr int64_t kParallelAppend = 1 << 16;

// Row t's V, read by the P·V pass just after, and row t of the next chunk's K (n rows on: the
// walk is in order) asked for while the scores are summed. The prefetchers alone left memory
// idle through each chunk's P·V pass: at 16K positions the attention took 22 % longer. The
// next chunk's address may lie past the cache, so it is formed as an integer: a prefetch never
// faults.
inline void ask_ahead(const uint16_t *k, const uint16_t *v, int64_t t, int64_t n, int64_t d) {
  const int64_t row = d * static_cast<int64_t>(sizeof(uint16_t));
  const uintptr_t v_row = reinterpret_cast<uintptr_t>(v) + t * row;
  const uintptr_t k_next = reinterpret_cast<uintptr_t>(k) + (t + n) * row;
  for (int64_t o = 0; o < row; o += 64) {
    _mm_prefetch(reinterpret_cast<const char *>(v_row + o), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char *>(k_next + o), _MM_HINT_T0);
  }
}

// The softmax's step over a chunk of n scores (p: C rows of ld floats; top: each head's chunk
// max in its lanes): each head's new running max, the old sums' factor e^(old max - new) into
// corr, p = bf16(e^(score - new max)) in place (and as bf16 in p16 where given), zeros past n
// to the row's whole vectors, and the total moved on by the chunk's sum of them (st: C pairs).
template <int C>
void probabilities(const nv::F16 *top, int64_t n, float *p, uint16_t *p16, int64_t ld, float *st, float *corr) {
  alignas(64) float was[kW] = {}, now[kW] = {};
  for (int h = 0; h < C; ++h) {
    was[h] = st[2 * h];
    now[h] = std::max(was[h], nv::reduce_max(top[h]));
  }
  nv::store_f32(corr, nv::exp_ps(nv::sub(nv::load_f32(was), nv::load_f32(now))));
  for (int h = 0; h < C; ++h) {
    float *ph = p + h * ld;
    const nv::F16 topv = nv::set1(now[h]);
    nv::F16 total = nv::zero();
    for (int64_t t = 0; t < n; t += kW) {
      const nv::F16 e = nv::keep(nv::lanes_below(n - t),
                                 nv::bf16_rounded(nv::exp_ps(nv::sub(nv::load_f32(ph + t, n - t), topv))));
      nv::store_f32(ph + t, e);
      if (p16 != nullptr) nv::store_bf16(p16 + h * ld + t, e);   // exact: e is a bf16 already
      total = nv::add(total, e);
    }
    st[2 * h] = now[h];
    st[2 * h + 1] = st[2 * h + 1] * corr[h] + nv::reduce_add(total);
  }
}

// C query heads (q: C rows of d) through one chunk of n positions (k, v: its first rows, d
// apart), for a head dim that is not whole pair blocks (pair_step takes those): the chunk's
// scores into p (C rows of ld floats), then each head's running max and total (st: C pairs)
// and its accumulator (acc: C rows of d, in order) moved on by the chunk. C and BL (head-dim
// blocks; 0: d's, known only at run time) are compile-time where they can be, so the sums of a
// row stay in registers.
template <int C, int BL>
void any_step(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t n, int64_t d, float scale, float *p,
              uint16_t *, int64_t ld, float *st, float *acc) {
  const int64_t blocks = BL ? BL : (d + kW - 1) / kW;
  nv::F16 qv[C][kMaxBlocks];
  for (int h = 0; h < C; ++h)
    for (int64_t b = 0; b < blocks; ++b) qv[h][b] = nv::load_bf16(q + h * d + kW * b, d - kW * b);

  // Scores, scaled, sixteen positions at a time; each head's chunk max in its lanes.
  nv::F16 part[C][kW], top[C];
  for (int h = 0; h < C; ++h) top[h] = nv::set1(kMaskFill);
  for (int64_t t0 = 0; t0 < n; t0 += kW) {
    const int64_t m = std::min<int64_t>(kW, n - t0);
    for (int64_t j = 0; j < kW; ++j) {
      if (j >= m) {
        for (int h = 0; h < C; ++h) part[h][j] = nv::zero();
        continue;
      }
      ask_ahead(k, v, t0 + j, n, d);
      const uint16_t *kt = k + (t0 + j) * d;
      nv::F16 kb[kMaxBlocks];
      for (int64_t b = 0; b < blocks; ++b) kb[b] = nv::load_bf16(kt + kW * b, d - kW * b);
      for (int h = 0; h < C; ++h) {
        nv::F16 s = nv::zero();
        for (int64_t b = 0; b < blocks; ++b) s = nv::fma(qv[h][b], kb[b], s);
        part[h][j] = s;
      }
    }
    for (int h = 0; h < C; ++h) {
      const nv::F16 sc = nv::mul(nv::reduce_add16(part[h]), nv::set1(scale));
      nv::store_f32(p + h * ld + t0, sc);
      top[h] = nv::max_where(top[h], nv::lanes_below(m), sc);
    }
  }

  alignas(64) float corr[kW];
  probabilities<C>(top, n, p, nullptr, ld, st, corr);

  // acc = acc · corr + Σ p·V over the chunk's positions in order, a head-dim block at a time.
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t left = d - kW * b;
    nv::F16 a[C];
    for (int h = 0; h < C; ++h) a[h] = nv::mul(nv::load_f32(acc + h * d + kW * b, left), nv::set1(corr[h]));
    for (int64_t t = 0; t < n; ++t) {
      const nv::F16 vb = nv::load_bf16(v + t * d + kW * b, left);
      for (int h = 0; h < C; ++h) a[h] = nv::fma(nv::set1(p[h * ld + t]), vb, a[h]);
    }
    for (int h = 0; h < C; ++h) nv::store_f32(acc + h * d + kW * b, a[h], left);
  }
}

// The pair form: head dims in blocks of kPairDims, each kW bf16 pairs. Scores sum the q·K
// pairs of a lane, the odd product and then the even one, each rounded (`dot_lanes`: vdpbf16ps
// on AVX512-BF16, two FMAs elsewhere). P·V takes the positions two at a time: the rows t and
// t + 1 interleaved into pairs (V[t][i], V[t + 1][i]), times the pair (p[t], p[t + 1]) of
// probabilities, which are bf16 already, so the products are exact (nv::dot). On AVX512-BF16
// that is half the instructions of widening both operands to f32 for FMAs; elsewhere it is as
// many. Every class rounds each dim's sums in the same order, so the bits are the same; which
// lane holds which dim differs by class (pv_in_order), and the accumulator stays in that lane order
// until its split is done (head_pass).
constexpr int64_t kPairDims = 2 * kW;

inline nv::F16 dot_lanes(nv::F16 acc, const nv::W16 &a, const nv::W16 &b) {
#if NATIVE_AVX512 && !NATIVE_DOT_FMA
  return {_mm512_dpbf16_ps(acc.v, a.v, b.v)};
#elif NATIVE_AVX512
  return {_mm512_fmadd_ps(a.even, b.even, _mm512_fmadd_ps(a.odd, b.odd, acc.v))};
#else
  return {_mm256_fmadd_ps(a.even_lo, b.even_lo, _mm256_fmadd_ps(a.odd_lo, b.odd_lo, acc.lo)),
          _mm256_fmadd_ps(a.even_hi, b.even_hi, _mm256_fmadd_ps(a.odd_hi, b.odd_hi, acc.hi))};
#endif
}

// The pair (p[0], p[1]) in every lane, from the f32 probabilities or their bf16 copy (p16),
// whichever the class's nv::dot takes; only AVX512-BF16 asks for the copy (kProbsBf16).
#if NATIVE_AVX512 && !NATIVE_DOT_FMA
constexpr bool kProbsBf16 = true;
inline nv::X2 prob_pair(const float *, const uint16_t *p16) {
  uint32_t pair;
  std::memcpy(&pair, p16, sizeof pair);
  return nv::bcast_pair(pair);
}
#elif NATIVE_AVX512
constexpr bool kProbsBf16 = false;
inline nv::X2 prob_pair(const float *p, const uint16_t *) { return nv::bcast_f32(p); }
#else
constexpr bool kProbsBf16 = false;
inline nv::X2 prob_pair(const float *p, const uint16_t *) { return {_mm256_set1_ps(p[0]), _mm256_set1_ps(p[1])}; }
#endif

// P·V's dims per block, as kPvVectors accumulators of kW lanes a head: the rows' pairs of a
// block made by one interleave of each row's kPvDims bf16 (vpunpck[lh]wd, which pairs words
// within each 128 bits: 32 dims on AVX-512, 16 on AVX2, whose 16 accumulators hold no more).
#if NATIVE_AVX512
constexpr int kPvVectors = 2;
inline void row_pairs(const uint16_t *a, const uint16_t *b, nv::P16 *out) {
  const __m512i ra = _mm512_loadu_si512(a), rb = _mm512_loadu_si512(b);
  out[0] = {_mm512_unpacklo_epi16(ra, rb)};
  out[1] = {_mm512_unpackhi_epi16(ra, rb)};
}
#else
constexpr int kPvVectors = 1;
inline void row_pairs(const uint16_t *a, const uint16_t *b, nv::P16 *out) {
  const __m256i ra = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a));
  const __m256i rb = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b));
  out[0] = {_mm256_unpacklo_epi16(ra, rb), _mm256_unpackhi_epi16(ra, rb)};
}
#endif
constexpr int64_t kPvDims = kPvVectors * kW;
static_assert(kPairDims % kPvDims == 0, "a pair block is whole P·V blocks");

// One P·V block of accumulators, stored as its kPvVectors vectors, put in dim order in place.
// The unpacks pair words 0-3 of each 128 bits in the first vector, words 4-7 in the second
// (`row_pairs`): on AVX-512 the first holds dims 0-3, 8-11, 16-19, 24-27 of the block's 32;
// on AVX2, 0-3 and 8-11 in the first, 4-7 and 12-15 in the second.
inline void pv_in_order(float *block) {
#if NATIVE_AVX512
  const __m512 lo = _mm512_loadu_ps(block), hi = _mm512_loadu_ps(block + kW);
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(block, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(block + kW, _mm512_permutex2var_ps(lo, second, hi));
#else
  const __m256 lo = _mm256_loadu_ps(block), hi = _mm256_loadu_ps(block + kW / 2);
  _mm256_storeu_ps(block, _mm256_permute2f128_ps(lo, hi, 0x20));
  _mm256_storeu_ps(block + kW / 2, _mm256_permute2f128_ps(lo, hi, 0x31));
#endif
}

// A row of zeros: the partner of a chunk's last row when its positions are odd.
alignas(64) const uint16_t kZeroRow[kMaxHeadDim] = {};

// C query heads through one chunk of n positions, as any_step, for a head dim of whole pair
// blocks (BL of them; 0: known only at run time); acc in P·V's lane order (pv_in_order).
template <int C, int BL>
void pair_step(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t n, int64_t d, float scale, float *p,
               uint16_t *p16, int64_t ld, float *st, float *acc) {
  constexpr int64_t kMaxPairBlocks = kMaxHeadDim / kPairDims;
  const int64_t blocks = BL ? BL : d / kPairDims;
  nv::W16 qw[C][kMaxPairBlocks];
  for (int h = 0; h < C; ++h)
    for (int64_t b = 0; b < blocks; ++b) qw[h][b] = nv::widen(nv::load_pairs(q + h * d + kPairDims * b));

  nv::F16 part[C][kW], top[C];
  for (int h = 0; h < C; ++h) top[h] = nv::set1(kMaskFill);
  for (int64_t t0 = 0; t0 < n; t0 += kW) {
    const int64_t m = std::min<int64_t>(kW, n - t0);
    for (int64_t j = 0; j < kW; ++j) {
      if (j >= m) {
        for (int h = 0; h < C; ++h) part[h][j] = nv::zero();
        continue;
      }
      ask_ahead(k, v, t0 + j, n, d);
      const uint16_t *kt = k + (t0 + j) * d;
      nv::W16 kb[kMaxPairBlocks];
      for (int64_t b = 0; b < blocks; ++b) kb[b] = nv::widen(nv::load_pairs(kt + kPairDims * b));
      for (int h = 0; h < C; ++h) {
        nv::F16 s = nv::zero();
        for (int64_t b = 0; b < blocks; ++b) s = dot_lanes(s, qw[h][b], kb[b]);
        part[h][j] = s;
      }
    }
    for (int h = 0; h < C; ++h) {
      const nv::F16 sc = nv::mul(nv::reduce_add16(part[h]), nv::set1(scale));
      nv::store_f32(p + h * ld + t0, sc);
      top[h] = nv::max_where(top[h], nv::lanes_below(m), sc);
    }
  }
  alignas(64) float corr[kW];
  probabilities<C>(top, n, p, kProbsBf16 ? p16 : nullptr, ld, st, corr);

  const int64_t pairs = n / 2;
  for (int64_t b = 0; b < d / kPvDims; ++b) {
    nv::F16 a[C][kPvVectors];
    for (int h = 0; h < C; ++h)
      for (int i = 0; i < kPvVectors; ++i)
        a[h][i] = nv::mul(nv::load_f32(acc + h * d + kPvDims * b + kW * i), nv::set1(corr[h]));
    for (int64_t t2 = 0; t2 <= pairs; ++t2) {
      const int64_t t = 2 * t2;
      if (t >= n) break;
      nv::P16 rows[kPvVectors];
      row_pairs(v + t * d + kPvDims * b, t + 1 < n ? v + (t + 1) * d + kPvDims * b : kZeroRow, rows);
      nv::W16 w[kPvVectors];
      for (int i = 0; i < kPvVectors; ++i) w[i] = nv::widen(rows[i]);
      for (int h = 0; h < C; ++h) {
        const nv::X2 x = prob_pair(p + h * ld + t, p16 + h * ld + t);
        for (int i = 0; i < kPvVectors; ++i) a[h][i] = nv::dot(a[h][i], w[i], x);
      }
    }
    for (int h = 0; h < C; ++h)
      for (int i = 0; i < kPvVectors; ++i) nv::store_f32(acc + h * d + kPvDims * b + kW * i, a[h][i]);
  }
}

using StepFn = void (*)(const uint16_t *, const uint16_t *, const uint16_t *, int64_t, int64_t, float, float *,
                        uint16_t *, int64_t, float *, float *);

template <template <int, int> class Step, int BL>
StepFn step_for(int c) {
  switch (c) {
    case 1: return Step<1, BL>::fn;
    case 2: return Step<2, BL>::fn;
    case 3: return Step<3, BL>::fn;
    default: return Step<4, BL>::fn;
  }
}
static_assert(kHeads == 4, "step_for instantiates 1..4 heads");

template <int C, int BL>
struct Pair {
  static constexpr StepFn fn = pair_step<C, BL>;
};
template <int C, int BL>
struct Any {
  static constexpr StepFn fn = any_step<C, BL>;
};

// Whether head dim d takes the pair form (and its lane order).
constexpr bool paired(int64_t d) { return d % kPairDims == 0; }

// The common head dims at compile time (64: Llama 3.2 1B; 128: Llama 3.2 3B, 3.1 8B).
StepFn step_fn(int c, int64_t d) {
  switch (d) {
    case 64: return step_for<Pair, 2>(c);
    case 128: return step_for<Pair, 4>(c);
    default: return paired(d) ? step_for<Pair, 0>(c) : step_for<Any, 0>(c);
  }
}

// rows rows of d accumulators in P·V's lane order (pv_in_order) put in dim order, in place.
void dims_in_order(float *acc, int64_t rows, int64_t d) {
  for (float *at = acc; at < acc + rows * d; at += kPvDims) pv_in_order(at);
}

// decode_attn's shape, as its `shape` words hold it.
struct Shape {
  int64_t kv_heads, group, d, capacity, chunk, splits;
};

// KV head g's splits s0..s1-1 over positions 0..n-1: the head's chunks walked in order, each
// moving on its own split's state (so each split still takes its chunks in order, as the
// contract has it, while memory is read as one forward stream; a split at a time, stepping
// over the others' chunks, took 30 % longer at 32K positions). A split's state: its
// accumulator (group rows of d) and its max and total (group pairs), `group` rows apart from
// the next split's. p, p16: a chunk's probabilities for kHeads heads, rows ld apart.
void head_pass(const Shape &sh, const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t n, int64_t g,
               int64_t s0, int64_t s1, float *acc, float *st, float *p, uint16_t *p16, int64_t ld) {
  const int64_t group = sh.group, d = sh.d;
  for (int64_t s = s0; s < s1; ++s) {
    for (int64_t h = 0; h < group; ++h) st[(s * group + h) * 2] = kMaskFill, st[(s * group + h) * 2 + 1] = 0.0f;
    std::memset(acc + s * group * d, 0, group * d * sizeof(float));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const uint16_t *qg = q + g * group * d, *kg = k + g * sh.capacity * d, *vg = v + g * sh.capacity * d;
  for (int64_t c = 0; c * sh.chunk < n; ++c) {
    const int64_t s = c % sh.splits;
    if (s < s0 || s >= s1) continue;
    const int64_t lo = c * sh.chunk, len = std::min(sh.chunk, n - lo);
    for (int64_t h = 0; h < group; h += kHeads) {
      const int heads = static_cast<int>(std::min<int64_t>(kHeads, group - h));
      step_fn(heads, d)(qg + h * d, kg + lo * d, vg + lo * d, len, d, scale, p, p16, ld, st + (s * group + h) * 2,
                        acc + (s * group + h) * d);
    }
  }
  if (paired(d)) dims_in_order(acc + s0 * group * d, (s1 - s0) * group, d);
}

}  // namespace

extern "C" int64_t resident_kv_bf16_cpu_max_head_dim() { return kMaxHeadDim; }

// k, v: `rows` token-major rows [rows, kv_heads, d]; k_cache, v_cache: [kv_heads, capacity, d].
// shape: rows, kv_heads, d, capacity. The rows go to positions *start.. of every head.
extern "C" void kv_append_bf16_cpu(const uint16_t *k, const uint16_t *v, const int32_t *start, uint16_t *k_cache,
                                   uint16_t *v_cache, const int64_t *shape, int32_t *status) {
  const int64_t rows = shape[0], kv_heads = shape[1], d = shape[2], capacity = shape[3];
  const int64_t at = *start;
  if (at < 0 || at > capacity - rows) {
    *status = 1;
    return;
  }
  *status = 0;
  const size_t bytes = d * sizeof(uint16_t);
#pragma omp parallel for schedule(static) if (rows * kv_heads * d > kParallelAppend)
  for (int64_t g = 0; g < kv_heads; ++g) {
    uint16_t *kc = k_cache + (g * capacity + at) * d, *vc = v_cache + (g * capacity + at) * d;
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(kc + r * d, k + (r * kv_heads + g) * d, bytes);
      std::memcpy(vc + r * d, v + (r * kv_heads + g) * d, bytes);
    }
  }
}

// q: [kv_heads · group, d] (KV head g's query heads g·group..); k, v: [kv_heads, capacity, d];
// acc: [kv_heads, splits, group, d] f32; stats: [kv_heads, splits, group, 2] f32 (max, total).
// shape: kv_heads, group, d, capacity, chunk, splits. Positions 0..*pos are attended.
extern "C" void decode_attn_bf16_cpu(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *pos,
                                     float *acc, float *stats, const int64_t *shape, int32_t *status) {
  const Shape sh{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5]};
  const int64_t n = static_cast<int64_t>(*pos) + 1;
  if (n < 1 || n > sh.capacity) {
    *status = 1;
    return;
  }
  *status = 0;
  const int64_t ld = (sh.chunk + kW - 1) / kW * kW;   // whole blocks of a chunk's scores
  const int64_t items = sh.kv_heads * sh.splits;
  // Each thread takes a contiguous run of the (KV head, split) items and walks each head's part
  // of it in one pass (head_pass). Which thread computes an item never changes its numbers.
#pragma omp parallel if (n * sh.d * sh.kv_heads > kParallelAbove)
  {
    std::vector<float> p(kHeads * ld);
    std::vector<uint16_t> p16(kHeads * ld);
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t hi = items * (me + 1) / team;
    for (int64_t it = items * me / team; it < hi;) {
      const int64_t g = it / sh.splits, s0 = it % sh.splits, s1 = std::min(sh.splits, s0 + hi - it);
      const int64_t at = g * sh.splits * sh.group;
      head_pass(sh, q, k, v, n, g, s0, s1, acc + at * sh.d, stats + at * 2, p.data(), p16.data(), ld);
      it += s1 - s0;
    }
  }
}

// acc, stats: decode_attn's; out: [kv_heads · group, d] bf16. Each query head's splits
// rescaled to their largest max (weights e^(max - largest)), sums and totals added in split
// order, their quotient rounded once.
extern "C" void attn_merge_bf16_cpu(const float *acc, const float *stats, uint16_t *out, int64_t kv_heads,
                                    int64_t splits, int64_t group, int64_t d) {
  alignas(64) float num[kMaxHeadDim];
  for (int64_t g = 0; g < kv_heads; ++g) {
    for (int64_t h = 0; h < group; ++h) {
      const float *st = stats + (g * splits * group + h) * 2;
      const float *a = acc + (g * splits * group + h) * d;
      const int64_t st_step = group * 2, a_step = group * d;
      float top = st[0];
      for (int64_t s = 1; s < splits; ++s) top = std::max(top, st[s * st_step]);
      std::fill(num, num + d, 0.0f);
      float den = 0.0f;
      for (int64_t s = 0; s < splits; ++s) {
        const float w = nv::reduce_max(nv::exp_ps(nv::set1(st[s * st_step] - top)));   // the kernels' own e^x
        den += st[s * st_step + 1] * w;
        const nv::F16 wv = nv::set1(w);
        for (int64_t i = 0; i < d; i += kW) {
          const nv::F16 term = nv::mul(nv::load_f32(a + s * a_step + i, d - i), wv);
          nv::store_f32(num + i, nv::add(nv::load_f32(num + i, d - i), term), d - i);
        }
      }
      const nv::F16 dv = nv::set1(den);
      uint16_t *o = out + (g * group + h) * d;
      for (int64_t i = 0; i < d; i += kW) nv::store_bf16(o + i, nv::div(nv::load_f32(num + i, d - i), dv), d - i);
    }
  }
}
