// Causal GQA attention of a prompt chunk over the cached context: prefill's flash_attn launch on
// the host CPU. bf16 in and out, f32 scores and softmax.
//
// torch's fused attention wants heads first and widens K/V for each query group, so a short
// prompt spends most of its attention time on layout, and at 2048 positions it runs far below
// the CPU's bf16 rate. This kernel reads the launch's own layouts (token-major Q and output,
// head-major cache) and works as flash attention does: a task is 16 queries of one head, and
// the visible keys stream past it in blocks of 64. Scores come from bf16 pair dot products,
// the softmax is online in f32, and the probabilities are rounded to bf16 for the product with
// V, as torch's CPU kernel rounds them for its second GEMM. Each output is divided by its sum
// and rounded to bf16 once.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd_bf16.h"

namespace {

namespace nv = native;

constexpr int64_t kBQ = 16;             // queries per task
#if NATIVE_AVX512
constexpr int64_t kQ = 4;               // queries per register tile
#else
constexpr int64_t kQ = 2;               // half the registers, each half the width
#endif
constexpr int64_t kBK = 64;             // keys per block
constexpr int64_t kGroups = kBK / nv::kWidth;   // 16-key vectors per block
constexpr int64_t kDC = 64;             // head dims per P·V register tile
constexpr int64_t kMaxHeadDim = 256;

struct Problem {
  const uint32_t *q;     // [s, hq, d/2] bf16 pairs
  uint16_t *out;         // [s, hq, d]
  const uint32_t *kp;    // [hk, blocks, d/2, kBK]: one (dim, dim+1) pair of each key
  const uint32_t *vp;    // [hk, blocks, kBK/2, d]: each dim of one (key, key+1) pair
  int64_t s, c, hq, hk, d, start, blocks;
  float scale;
};

// Cache rows [0, c) of every KV head into the pair layouts the two products want; keys past c
// are zero, and their probabilities are zero too.
void pack(const uint16_t *k, const uint16_t *v, int64_t stride, const Problem &p, uint32_t *kp, uint32_t *vp) {
  const int64_t half = p.d / 2;
#pragma omp for schedule(static) collapse(2)
  for (int64_t g = 0; g < p.hk; ++g)
    for (int64_t b = 0; b < p.blocks; ++b) {
      uint32_t *kb = kp + (g * p.blocks + b) * half * kBK;
      uint32_t *vb = vp + (g * p.blocks + b) * (kBK / 2) * p.d;
      for (int64_t t = 0; t < kBK; ++t) {
        const int64_t key = b * kBK + t;
        const uint32_t *row = reinterpret_cast<const uint32_t *>(k + (g * stride + key) * p.d);
        for (int64_t i = 0; i < half; ++i) kb[i * kBK + t] = key < p.c ? row[i] : 0;
      }
      for (int64_t t = 0; t < kBK; t += 2) {
        const int64_t key = b * kBK + t;
        const uint16_t *r0 = v + (g * stride + key) * p.d, *r1 = r0 + p.d;
        for (int64_t i = 0; i < p.d; ++i) {
          const uint32_t lo = key < p.c ? r0[i] : 0, hi = key + 1 < p.c ? r1[i] : 0;
          vb[(t / 2) * p.d + i] = lo | hi << 16;
        }
      }
    }
}

struct Tile {
  alignas(64) float o[kBQ][kMaxHeadDim];
  alignas(64) uint16_t prob[kBQ][kBK];
  float m[kBQ], l[kBQ];
};

// Scores of up to kQ queries (rows i0 + qi ..) against key block b, folded into the running
// softmax: rescales each query's output row and leaves its bf16 probabilities in t.prob.
void scores(const Problem &p, int64_t h, int64_t i0, int64_t qi, int64_t nq, int64_t b, Tile &t) {
  const int64_t half = p.d / 2, g = h / (p.hq / p.hk);
  const uint32_t *kb = p.kp + (g * p.blocks + b) * half * kBK;
  const uint32_t *qrow[kQ];
  for (int64_t j = 0; j < kQ; ++j) {
    const int64_t i = i0 + (qi + j < nq ? qi + j : nq - 1);
    qrow[j] = p.q + (i * p.hq + h) * half;
  }
  nv::F16 acc[kQ][kGroups];
  for (auto &row : acc)
    for (auto &a : row) a = nv::zero();
  for (int64_t i = 0; i < half; ++i) {
    nv::W16 kv[kGroups];
    for (int64_t gr = 0; gr < kGroups; ++gr) kv[gr] = nv::widen(nv::load_pairs(kb + i * kBK + nv::kWidth * gr));
    for (int64_t j = 0; j < kQ; ++j) {
      const nv::X2 qv = nv::bcast_pair(qrow[j][i]);
      for (int64_t gr = 0; gr < kGroups; ++gr) acc[j][gr] = nv::dot(acc[j][gr], kv[gr], qv);
    }
  }
  for (int64_t j = 0; j < kQ && qi + j < nq; ++j) {
    const int64_t r = qi + j;
    const int64_t visible = std::min(p.start + i0 + r + 1, p.c);   // keys [0, visible)
    nv::M16 ok[kGroups];
    nv::F16 sv[kGroups];
    nv::F16 top = nv::set1(-INFINITY);
    for (int64_t gr = 0; gr < kGroups; ++gr) {
      ok[gr] = nv::lanes_below(visible - (b * kBK + nv::kWidth * gr));
      sv[gr] = nv::mul(acc[j][gr], nv::set1(p.scale));
      top = nv::max_where(top, ok[gr], sv[gr]);
    }
    const float m_new = std::max(t.m[r], nv::reduce_max(top));
    const float alpha = t.m[r] == -INFINITY ? 0.0f : std::exp(t.m[r] - m_new);
    nv::F16 sum = nv::zero();
    for (int64_t gr = 0; gr < kGroups; ++gr) {
      const nv::F16 e = nv::keep(ok[gr], nv::exp_ps(nv::sub(sv[gr], nv::set1(m_new))));
      sum = nv::add(sum, e);
      nv::store_bf16(t.prob[r] + nv::kWidth * gr, e);
    }
    t.l[r] = t.l[r] * alpha + nv::reduce_add(sum);
    t.m[r] = m_new;
    if (alpha != 1.0f)
      for (int64_t i = 0; i < p.d; i += nv::kWidth)
        nv::store_f32(t.o[r] + i, nv::mul(nv::load_f32(t.o[r] + i), nv::set1(alpha)));
  }
}

// o[qi..] += prob[qi..] · V over key block b, kQ queries by kDC dims at a time in registers.
void weighted_values(const Problem &p, int64_t h, int64_t qi, int64_t nq, int64_t b, Tile &t) {
  const int64_t g = h / (p.hq / p.hk);
  const uint32_t *vb = p.vp + (g * p.blocks + b) * (kBK / 2) * p.d;
  const uint32_t *prow[kQ];
  for (int64_t j = 0; j < kQ; ++j) prow[j] = reinterpret_cast<const uint32_t *>(t.prob[qi + j < nq ? qi + j : nq - 1]);
  for (int64_t dc = 0; dc < p.d; dc += kDC) {
    constexpr int64_t kV = kDC / nv::kWidth;
    nv::F16 acc[kQ][kV];
    for (int64_t j = 0; j < kQ; ++j)
      for (int64_t v = 0; v < kV; ++v) acc[j][v] = nv::load_f32(t.o[qi + j] + dc + nv::kWidth * v);
    for (int64_t kp = 0; kp < kBK / 2; ++kp) {
      nv::W16 vv[kV];
      for (int64_t v = 0; v < kV; ++v) vv[v] = nv::widen(nv::load_pairs(vb + kp * p.d + dc + nv::kWidth * v));
      for (int64_t j = 0; j < kQ; ++j) {
        const nv::X2 pr = nv::bcast_pair(prow[j][kp]);
        for (int64_t v = 0; v < kV; ++v) acc[j][v] = nv::dot(acc[j][v], vv[v], pr);
      }
    }
    for (int64_t j = 0; j < kQ && qi + j < nq; ++j)
      for (int64_t v = 0; v < kV; ++v) nv::store_f32(t.o[qi + j] + dc + nv::kWidth * v, acc[j][v]);
  }
}

void task(const Problem &p, int64_t h, int64_t qb) {
  Tile t;
  const int64_t i0 = qb * kBQ, nq = std::min(kBQ, p.s - i0);
  for (int64_t r = 0; r < kBQ; ++r) {
    t.m[r] = -INFINITY;
    t.l[r] = 0.0f;
    for (int64_t i = 0; i < p.d; ++i) t.o[r][i] = 0.0f;
  }
  const int64_t last = std::min(p.start + i0 + nq, p.c);   // keys any row of the task sees
  for (int64_t b = 0; b * kBK < last; ++b)
    for (int64_t qi = 0; qi < nq; qi += kQ) {
      scores(p, h, i0, qi, nq, b, t);
      weighted_values(p, h, qi, nq, b, t);
    }
  for (int64_t r = 0; r < nq; ++r) {
    const nv::F16 inv = nv::set1(1.0f / t.l[r]);
    uint16_t *dst = p.out + ((i0 + r) * p.hq + h) * p.d;
    for (int64_t i = 0; i < p.d; i += nv::kWidth) nv::store_bf16(dst + i, nv::mul(nv::load_f32(t.o[r] + i), inv));
  }
}

}  // namespace

extern "C" int64_t flash_attention_bf16_cpu_max_head_dim() { return kMaxHeadDim; }

// q, out: [s, hq, d]; k, v: [hk, stride, d] with rows [0, c) readable. Query i sits at position
// start + i and sees positions 0..start + i. d must be a multiple of kDC (64).
extern "C" void flash_attention_bf16_cpu(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                         int64_t s, int64_t c, int64_t hq, int64_t hk, int64_t d, int64_t start,
                                         int64_t stride) {
  c = std::min(c, start + s);   // rows past the last query's position are never read, even if stale
  Problem p{reinterpret_cast<const uint32_t *>(q), out, nullptr, nullptr, s, c, hq, hk, d, start,
            (c + kBK - 1) / kBK, 1.0f / std::sqrt(static_cast<float>(d))};
  static thread_local std::vector<uint32_t> kbuf, vbuf;
  kbuf.resize(p.hk * p.blocks * kBK * d / 2);
  vbuf.resize(kbuf.size());
  // Per calling thread; the team reaches them through these pointers, not its own thread_locals.
  uint32_t *const kp = kbuf.data(), *const vp = vbuf.data();
  p.kp = kp;
  p.vp = vp;
  const int64_t qblocks = (s + kBQ - 1) / kBQ, tasks = qblocks * hq;
#pragma omp parallel
  {
    pack(k, v, stride, p, kp, vp);
    // Later query blocks see more keys: hand them out first so the team ends together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; ++i) task(p, i % hq, qblocks - 1 - i / hq);
  }
}
