// Flash-attention tile primitives: a tile of query rows of one head against a stream of
// key/value tiles, with an online softmax so the full score matrix never exists; and the merge
// of split-K partial results.
//
// Call order per query tile (TQ rows, key tiles of TK positions, head size D):
//   init                      m = fill, l = 0, acc = 0
//   for each key/value tile:  qk -> s = q k^T / sqrt(D)          (f32 scores, TQ x TK)
//                             mask (tiles crossing the diagonal) s = fill where key > query
//                             softmax -> p = bf16(exp(s - m')), corr = exp(m - m'), l = l corr + sum p
//                             pv -> acc = acc * corr + p v
//   finalize                  o = bf16(acc / l)
//
// Prefill tiles are square (TQ = TK) and query row i sits at position q_pos0 + i (row step 1).
// Single-token decode streams the cache in chunks of TK positions against the TQ query heads
// that share one KV head: every row is the same token, so all rows sit at q_pos0 (row step
// 0). There a KV head's positions are split over several cores, each leaving its unnormalised
// acc and its (m, l) instead of finalizing; `merge` rescales the splits to their largest
// running max and divides once: out = bf16(sum_s w_s acc_s / sum_s w_s l_s), w_s = exp(m_s - max m).
//
// The masked-score fill is a large finite negative rather than -inf: max, subtraction and
// exp2 then never meet an infinity (inf - inf is NaN), and the fill's weight underflows to 0
// next to any real score. A row that sees only masked keys in one tile gets uniform weights
// that the next real tile's correction (exp(fill - real) = 0) erases; a causal schedule that
// starts at key 0 never even produces one. A decode split that streamed no chunk leaves
// m = fill, l = 0, acc = 0, which the merge weighs exp(fill - max) = 0.
//
// The denominator sums the bf16-rounded probabilities that p v actually uses, so the
// weights applied to v sum to one up to f32 rounding.
//
// Defines: ATTN_HEAD_DIM (D), ATTN_TILE_Q (TQ), ATTN_TILE_K (TK), ATTN_ROW_STEP (positions
// between query rows: 1 in prefill, 0 in decode), ATTN_SPLITS (merge only: splits per KV
// head, with TQ the query rows of one KV head), ATTN_ONLY (which primitive this object
// exports: init, qk, mask, softmax, pv, finalize or merge), ATTN_SYMBOL (its exported name).
#include "bf16.h"

#if !defined(__AIENGINE__)
#include <cmath>
#endif

namespace {

constexpr float kMaskFill = -1.0e30f;
constexpr float kLog2e = 1.4426950408889634f;

template <int D, int TQ>
void init(float *KRESTRICT m, float *KRESTRICT l, float *KRESTRICT acc) {
  for (int i = 0; i < TQ; ++i) {
    m[i] = kMaskFill;
    l[i] = 0.0f;
  }
  for (int i = 0; i < TQ * D; ++i)
    acc[i] = 0.0f;
}

// Positions are absolute, so one primitive serves prefill from offset 0, prefill of a later
// chunk against cached keys, any tile pairing a schedule chooses, and decode (STEP 0: every
// row is the token at q_pos0, so the columns past it are masked in all rows).
template <int TQ, int TK, int STEP>
void mask(float *KRESTRICT s, int32_t q_pos0, int32_t k_pos0) {
  for (int i = 0; i < TQ; ++i) {
    int first = q_pos0 + i * STEP - k_pos0 + 1; // first column whose key is after this query
    if (first < 0)
      first = 0;
    for (int j = first; j < TK; ++j)
      s[i * TK + j] = kMaskFill;
  }
}

#if defined(__AIENGINE__)

constexpr int kLanes = 32; // bf16 lanes per multiply-accumulate
constexpr int kF32Lanes = 16;

template <int D, int TQ, int TK>
void qk(const bf16 *KRESTRICT q, const bf16 *KRESTRICT k, float *KRESTRICT s) {
  static_assert(D % kLanes == 0, "head size must be a whole number of 32-lane vectors");
  constexpr float scale = inv_sqrt(D);
  for (int i = 0; i < TQ; ++i)
    for (int j = 0; j < TK; ++j) {
      aie::accum<accfloat, kLanes> acc = aie::zeros<accfloat, kLanes>();
      for (int c = 0; c < D; c += kLanes)
        acc = aie::mac(acc, aie::load_v<kLanes>(q + i * D + c), aie::load_v<kLanes>(k + j * D + c));
      s[i * TK + j] = aie::reduce_add(acc.template to_vector<float>()) * scale;
    }
}

// exp(x) for a scalar through the vector unit: the core has no scalar exp.
inline float exp_scalar(float x) {
  aie::vector<bf16, kF32Lanes> e = aie::exp2<bf16>(aie::broadcast<float, kF32Lanes>(x * kLog2e));
  return bf16_to_f32(static_cast<bf16>(e[0]));
}

template <int TQ, int TK>
void softmax(const float *KRESTRICT s, float *KRESTRICT m, float *KRESTRICT l, bf16 *KRESTRICT p,
             float *KRESTRICT corr) {
  static_assert(TK % kF32Lanes == 0, "a key tile must be a whole number of 16-lane vectors");
  const auto saved = aie::swap_rounding(aie::rounding_mode::conv_even);
  for (int i = 0; i < TQ; ++i) {
    const float *KRESTRICT row = s + i * TK;
    float row_max = m[i];
    for (int j = 0; j < TK; j += kF32Lanes) {
      const float v = aie::reduce_max(aie::load_v<kF32Lanes>(row + j));
      row_max = v > row_max ? v : row_max;
    }
    const aie::vector<float, kF32Lanes> m_new = aie::broadcast<float, kF32Lanes>(row_max);
    aie::accum<accfloat, kF32Lanes> sum = aie::zeros<accfloat, kF32Lanes>();
    for (int j = 0; j < TK; j += kF32Lanes) {
      aie::vector<float, kF32Lanes> d = aie::sub(aie::load_v<kF32Lanes>(row + j), m_new);
      aie::accum<accfloat, kF32Lanes> arg = aie::mul(d, kLog2e);
      aie::vector<bf16, kF32Lanes> e = aie::exp2<bf16>(arg.template to_vector<float>());
      aie::store_v(p + i * TK + j, e);
      sum = aie::add(sum, e);
    }
    corr[i] = exp_scalar(m[i] - row_max);
    l[i] = l[i] * corr[i] + aie::reduce_add(sum.template to_vector<float>());
    m[i] = row_max;
  }
  aie::set_rounding(saved);
}

template <int D, int TQ, int TK>
void pv(const bf16 *KRESTRICT p, const bf16 *KRESTRICT v, const float *KRESTRICT corr,
        float *KRESTRICT acc) {
  static_assert(D % kLanes == 0, "head size must be a whole number of 32-lane vectors");
  for (int i = 0; i < TQ; ++i)
    for (int c = 0; c < D; c += kLanes) {
      float *KRESTRICT out = acc + i * D + c;
      aie::accum<accfloat, kLanes> a = aie::mul(aie::load_v<kLanes>(out), corr[i]);
      for (int j = 0; j < TK; ++j)
        a = aie::mac(a, aie::load_v<kLanes>(v + j * D + c), p[i * TK + j]);
      aie::store_v(out, a.template to_vector<float>());
    }
}

template <int D, int TQ>
void finalize(const float *KRESTRICT acc, const float *KRESTRICT l, bf16 *KRESTRICT o) {
  static_assert(D % kF32Lanes == 0, "head size must be a whole number of 16-lane vectors");
  const auto saved = aie::swap_rounding(aie::rounding_mode::conv_even);
  for (int i = 0; i < TQ; ++i) {
    const float inv = aie::inv(l[i]);
    for (int c = 0; c < D; c += kF32Lanes) {
      aie::accum<accfloat, kF32Lanes> y = aie::mul(aie::load_v<kF32Lanes>(acc + i * D + c), inv);
      aie::store_v(o + i * D + c, y.template to_vector<bf16>());
    }
  }
  aie::set_rounding(saved);
}

// acc [S][G][D], stats [S][G][2] (running max, sum) -> out [G][D].
template <int D, int G, int S>
void merge(const float *KRESTRICT acc, const float *KRESTRICT stats, bf16 *KRESTRICT out) {
  static_assert(D % kF32Lanes == 0, "head size must be a whole number of 16-lane vectors");
  const auto saved = aie::swap_rounding(aie::rounding_mode::conv_even);
  for (int g = 0; g < G; ++g) {
    float top = kMaskFill;
    for (int s = 0; s < S; ++s) {
      const float m = stats[(s * G + g) * 2];
      top = m > top ? m : top;
    }
    float w[S];
    float den = 0.0f;
    for (int s = 0; s < S; ++s) {
      w[s] = exp_scalar(stats[(s * G + g) * 2] - top);
      den += w[s] * stats[(s * G + g) * 2 + 1];
    }
    const float inv = aie::inv(den);
    for (int c = 0; c < D; c += kF32Lanes) {
      aie::accum<accfloat, kF32Lanes> num = aie::zeros<accfloat, kF32Lanes>();
      for (int s = 0; s < S; ++s)
        num = aie::mac(num, aie::load_v<kF32Lanes>(acc + (s * G + g) * D + c), w[s]);
      aie::accum<accfloat, kF32Lanes> y = aie::mul(num.template to_vector<float>(), inv);
      aie::store_v(out + g * D + c, y.template to_vector<bf16>());
    }
  }
  aie::set_rounding(saved);
}

#else

template <int D, int TQ, int TK>
void qk(const bf16 *KRESTRICT q, const bf16 *KRESTRICT k, float *KRESTRICT s) {
  constexpr float scale = inv_sqrt(D);
  for (int i = 0; i < TQ; ++i)
    for (int j = 0; j < TK; ++j) {
      float dot = 0.0f;
      for (int c = 0; c < D; ++c)
        dot += bf16_to_f32(q[i * D + c]) * bf16_to_f32(k[j * D + c]);
      s[i * TK + j] = dot * scale;
    }
}

template <int TQ, int TK>
void softmax(const float *KRESTRICT s, float *KRESTRICT m, float *KRESTRICT l, bf16 *KRESTRICT p,
             float *KRESTRICT corr) {
  for (int i = 0; i < TQ; ++i) {
    const float *KRESTRICT row = s + i * TK;
    float row_max = m[i];
    for (int j = 0; j < TK; ++j)
      row_max = row[j] > row_max ? row[j] : row_max;
    float sum = 0.0f;
    for (int j = 0; j < TK; ++j) {
      const bf16 e = f32_to_bf16(std::exp(row[j] - row_max));
      p[i * TK + j] = e;
      sum += bf16_to_f32(e);
    }
    corr[i] = std::exp(m[i] - row_max);
    l[i] = l[i] * corr[i] + sum;
    m[i] = row_max;
  }
}

template <int D, int TQ, int TK>
void pv(const bf16 *KRESTRICT p, const bf16 *KRESTRICT v, const float *KRESTRICT corr,
        float *KRESTRICT acc) {
  for (int i = 0; i < TQ; ++i)
    for (int c = 0; c < D; ++c) {
      float a = acc[i * D + c] * corr[i];
      for (int j = 0; j < TK; ++j)
        a += bf16_to_f32(p[i * TK + j]) * bf16_to_f32(v[j * D + c]);
      acc[i * D + c] = a;
    }
}

template <int D, int TQ>
void finalize(const float *KRESTRICT acc, const float *KRESTRICT l, bf16 *KRESTRICT o) {
  for (int i = 0; i < TQ; ++i) {
    const float inv = 1.0f / l[i];
    for (int c = 0; c < D; ++c)
      o[i * D + c] = f32_to_bf16(acc[i * D + c] * inv);
  }
}

template <int D, int G, int S>
void merge(const float *KRESTRICT acc, const float *KRESTRICT stats, bf16 *KRESTRICT out) {
  for (int g = 0; g < G; ++g) {
    float top = kMaskFill;
    for (int s = 0; s < S; ++s) {
      const float m = stats[(s * G + g) * 2];
      top = m > top ? m : top;
    }
    float w[S];
    float den = 0.0f;
    for (int s = 0; s < S; ++s) {
      w[s] = std::exp(stats[(s * G + g) * 2] - top);
      den += w[s] * stats[(s * G + g) * 2 + 1];
    }
    for (int c = 0; c < D; ++c) {
      float num = 0.0f;
      for (int s = 0; s < S; ++s)
        num += acc[(s * G + g) * D + c] * w[s];
      out[g * D + c] = f32_to_bf16(num / den);
    }
  }
}

#endif

} // namespace

// ATTN_ONLY names the primitive; the preprocessor cannot compare names, so each maps to a
// number through token pasting.
#define ATTN_PRIM_init 1
#define ATTN_PRIM_qk 2
#define ATTN_PRIM_mask 3
#define ATTN_PRIM_softmax 4
#define ATTN_PRIM_pv 5
#define ATTN_PRIM_finalize 6
#define ATTN_PRIM_merge 7
#define ATTN_PASTE_(a, b) a##b
#define ATTN_PASTE(a, b) ATTN_PASTE_(a, b)
#define ATTN_SELECTED ATTN_PASTE(ATTN_PRIM_, ATTN_ONLY)

#if ATTN_SELECTED == ATTN_PRIM_init
extern "C" void ATTN_SYMBOL(float *KRESTRICT m, float *KRESTRICT l, float *KRESTRICT acc) {
  init<ATTN_HEAD_DIM, ATTN_TILE_Q>(m, l, acc);
}
#elif ATTN_SELECTED == ATTN_PRIM_qk
extern "C" void ATTN_SYMBOL(const bf16 *KRESTRICT q, const bf16 *KRESTRICT k, float *KRESTRICT s) {
  qk<ATTN_HEAD_DIM, ATTN_TILE_Q, ATTN_TILE_K>(q, k, s);
}
#elif ATTN_SELECTED == ATTN_PRIM_mask
extern "C" void ATTN_SYMBOL(float *KRESTRICT s, int32_t q_pos0, int32_t k_pos0) {
  mask<ATTN_TILE_Q, ATTN_TILE_K, ATTN_ROW_STEP>(s, q_pos0, k_pos0);
}
#elif ATTN_SELECTED == ATTN_PRIM_softmax
extern "C" void ATTN_SYMBOL(const float *KRESTRICT s, float *KRESTRICT m, float *KRESTRICT l,
                            bf16 *KRESTRICT p, float *KRESTRICT corr) {
  softmax<ATTN_TILE_Q, ATTN_TILE_K>(s, m, l, p, corr);
}
#elif ATTN_SELECTED == ATTN_PRIM_pv
extern "C" void ATTN_SYMBOL(const bf16 *KRESTRICT p, const bf16 *KRESTRICT v,
                            const float *KRESTRICT corr, float *KRESTRICT acc) {
  pv<ATTN_HEAD_DIM, ATTN_TILE_Q, ATTN_TILE_K>(p, v, corr, acc);
}
#elif ATTN_SELECTED == ATTN_PRIM_finalize
extern "C" void ATTN_SYMBOL(const float *KRESTRICT acc, const float *KRESTRICT l, bf16 *KRESTRICT o) {
  finalize<ATTN_HEAD_DIM, ATTN_TILE_Q>(acc, l, o);
}
#elif ATTN_SELECTED == ATTN_PRIM_merge
extern "C" void ATTN_SYMBOL(const float *KRESTRICT acc, const float *KRESTRICT stats, bf16 *KRESTRICT out) {
  merge<ATTN_HEAD_DIM, ATTN_TILE_Q, ATTN_SPLITS>(acc, stats, out);
}
#else
#error "ATTN_ONLY must be one of init, qk, mask, softmax, pv, finalize, merge"
#endif
