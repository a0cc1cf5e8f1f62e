// Single-query GQA attention over a head-major bf16 KV cache, f32 math: decode's host attention.
//
// One token's attention reads positions 0..pos of each KV head; at short contexts torch spends
// far longer dispatching the widen / matmul / softmax / matmul chain than reading. Here the
// query heads that share a KV head go through it together, up to kChunk at a time: each K and
// V row is widened once for all of them, and scores come sixteen positions at a time through
// one batched horizontal sum (simd_bf16.h's reduce_add16). At long contexts that is what
// bounds the kernel: a head at a time, widening each row per head and summing each score on
// its own, ran at 2-3 times the time its bytes take from memory. The softmax subtracts the
// max, as torch's does; each sum runs in a fixed order, so every ISA class gives the same bits.
// Beyond a few dozen positions the (KV head, chunk) pairs are split over the OpenMP team; long
// contexts are cut into segments as well, each a task of its own, whose sums are combined in
// order afterwards (`merge`).
#include <immintrin.h>

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

// K elements read (positions x head dim x KV heads) above which the team splits the work. In
// decode the team is awake from the GEMVs just before, so a parallel region costs about a
// microsecond: on SmolLM2's 3 KV heads at 130-150 positions, 17-20 µs against 23-29 on one
// thread (Zen 3, inside the recorded decode). Below this, a few dozen positions.
constexpr int64_t kParallelAbove = 1 << 12;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlocks = kMaxHeadDim / kW;
constexpr int kChunk = 4;                     // query heads per pass over a KV head
constexpr int64_t kTile = 64;                 // positions of V per pass over the head dims (L1)
// A long context's positions are cut into segments, for two reasons. Where its (KV head, chunk)
// tasks are too few to keep the team busy: SmolLM2's 3 KV heads left one of two threads idle
// for a third of the attention, which at 4000 positions is more than half of a token. And so
// that a segment's V rows, asked for while its scores are summed, are still in the core's L2
// when the P·V pass reads them. Every number here depends on the shape alone, never on the
// team, so a result has the same bits on any number of threads.
constexpr int64_t kFewTasks = 8;              // at least this many tasks: no split for balance
constexpr int64_t kMinSegment = 512;          // positions a segment keeps at the least, for balance
constexpr int64_t kSegmentBytes = 128 * 1024; // V bytes a segment holds at most

// C query heads (q: C rows of d) over positions 0..n-1 of one KV head; `p` holds C rows of `ld`
// floats for the probabilities. C and BL (head-dim blocks; 0: d's, known only at run time) are
// compile-time where they can be, so the sums of a row stay in registers. With `partial`, the
// positions are one segment of a longer context: each head's scores' maximum, its total and
// its unnormalized sums (d + 2 floats, `partial_ld` apart) go there for `merge`; else `out`
// gets the result.
template <int C, int BL>
void head_chunk(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t n, int64_t d,
                float scale, float *p, int64_t ld, float *partial, int64_t partial_ld) {
  const int64_t blocks = BL ? BL : (d + kW - 1) / kW;
  nv::F16 qv[C][kMaxBlocks];
  for (int h = 0; h < C; ++h)
    for (int64_t b = 0; b < blocks; ++b) qv[h][b] = nv::load_bf16(q + h * d + kW * b, d - kW * b);

  // Scores, scaled, sixteen positions at a time; each head's running max in its lanes.
  nv::F16 part[C][kW], top[C];
  for (int h = 0; h < C; ++h) top[h] = nv::set1(-INFINITY);
  for (int64_t t0 = 0; t0 < n; t0 += kW) {
    const int64_t m = std::min<int64_t>(kW, n - t0);
    for (int64_t j = 0; j < kW; ++j) {
      if (j >= m) {
        for (int h = 0; h < C; ++h) part[h][j] = nv::zero();
        continue;
      }
      const uint16_t *kt = k + (t0 + j) * d;
      // V's row, asked for now: the P·V pass below then reads it from L2, and memory serves two
      // streams at once here instead of one stream in each pass (13-22 % off the attention at
      // 130-2000 positions, docs/profile.md). A prefetch never faults, and this row is read.
      for (int64_t o = 0; o < d * static_cast<int64_t>(sizeof(uint16_t)); o += 64)
        _mm_prefetch(reinterpret_cast<const char *>(v + (t0 + j) * d) + o, _MM_HINT_T0);
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

  // e^(score - max) and each head's total.
  float inv[C], top1[C], total1[C];
  for (int h = 0; h < C; ++h) {
    float *ph = p + h * ld;
    top1[h] = nv::reduce_max(top[h]);
    const nv::F16 topv = nv::set1(top1[h]);
    nv::F16 total = nv::zero();
    for (int64_t t = 0; t < n; t += kW) {
      const nv::F16 e = nv::keep(nv::lanes_below(n - t), nv::exp_ps(nv::sub(nv::load_f32(ph + t, n - t), topv)));
      nv::store_f32(ph + t, e, n - t);
      total = nv::add(total, e);
    }
    total1[h] = nv::reduce_add(total);
    inv[h] = 1.0f / total1[h];
  }

  // Σ p·V over positions in order, a tile of V rows at a time, each head dim block's sums in
  // registers while they stream through the tile.
  nv::F16 acc[C][kMaxBlocks];
  for (int h = 0; h < C; ++h)
    for (int64_t b = 0; b < blocks; ++b) acc[h][b] = nv::zero();
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t t1 = std::min(n, t0 + kTile);
    for (int64_t b = 0; b < blocks; ++b) {
      nv::F16 a[C];
      for (int h = 0; h < C; ++h) a[h] = acc[h][b];
      for (int64_t t = t0; t < t1; ++t) {
        const nv::F16 vb = nv::load_bf16(v + t * d + kW * b, d - kW * b);
        for (int h = 0; h < C; ++h) a[h] = nv::fma(nv::set1(p[h * ld + t]), vb, a[h]);
      }
      for (int h = 0; h < C; ++h) acc[h][b] = a[h];
    }
  }
  for (int h = 0; h < C; ++h) {
    if (partial != nullptr) {
      float *ph = partial + h * partial_ld;
      ph[0] = top1[h];
      ph[1] = total1[h];
      for (int64_t b = 0; b < blocks; ++b) nv::store_f32(ph + 2 + kW * b, acc[h][b], d - kW * b);
    } else {
      for (int64_t b = 0; b < blocks; ++b)
        nv::store_bf16(out + h * d + kW * b, nv::mul(acc[h][b], nv::set1(inv[h])), d - kW * b);
    }
  }
}

// One query head's segments combined, in segment order: each segment's sums and total rescaled
// by e^(its max - the overall max), the sums then divided by the rescaled totals' sum.
void merge(const float *part, int64_t segs, int64_t stride, int64_t d, uint16_t *out) {
  float top = -INFINITY;
  for (int64_t s = 0; s < segs; ++s) top = std::max(top, part[s * stride]);
  float acc[kMaxHeadDim] = {};
  float total = 0.0f;
  for (int64_t s = 0; s < segs; ++s) {
    const float *ps = part + s * stride;
    const float w = nv::reduce_max(nv::exp_ps(nv::set1(ps[0] - top)));   // the kernel's own e^x
    total += w * ps[1];
    for (int64_t i = 0; i < d; ++i) acc[i] += w * ps[2 + i];
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < d; i += kW)
    nv::store_bf16(out + i, nv::mul(nv::load_f32(acc + i, d - i), nv::set1(inv)), d - i);
}

using ChunkFn = void (*)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, float,
                        float *, int64_t, float *, int64_t);

template <int BL>
ChunkFn chunk_for(int c) {
  switch (c) {
    case 1: return head_chunk<1, BL>;
    case 2: return head_chunk<2, BL>;
    case 3: return head_chunk<3, BL>;
    default: return head_chunk<4, BL>;
  }
}
static_assert(kChunk == 4, "chunk_for instantiates 1..4 heads");

// Whole blocks of the common head dims (64: Llama 3.2 1B, SmolLM2) at compile time.
ChunkFn chunk_fn(int c, int64_t d) {
  switch (d) {
    case 32: return chunk_for<2>(c);
    case 64: return chunk_for<4>(c);
    case 128: return chunk_for<8>(c);
    default: return chunk_for<0>(c);
  }
}

}  // namespace

extern "C" int64_t attention_bf16_cpu_max_head_dim() { return kMaxHeadDim; }

// q, out: [heads, d]; k, v: [kv_heads, stride, d] (one layer of the cache), positions 0..n-1 read.
extern "C" void attention_bf16_cpu(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                   int64_t heads, int64_t kv_heads, int64_t d, int64_t n, int64_t stride) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t group = heads / kv_heads, chunks = (group + kChunk - 1) / kChunk;
  const int64_t tasks = kv_heads * chunks;
  const int64_t balance =
      tasks >= kFewTasks ? 1 : std::clamp<int64_t>(n / kMinSegment, 1, (kFewTasks + tasks - 1) / tasks);
  const int64_t rows = std::max<int64_t>(1, kSegmentBytes / (d * static_cast<int64_t>(sizeof(uint16_t))));
  const int64_t segs = std::max(balance, (n + rows - 1) / rows);
  const int64_t seg = (n + segs - 1) / segs;
  const int64_t ld = (seg + kW - 1) / kW * kW;   // whole blocks of a segment's scores
  const int64_t pstride = d + 2;                 // a head's segment in `partials`
  std::vector<float> partials(segs > 1 ? heads * segs * pstride : 0);
#pragma omp parallel if (n * d * kv_heads > kParallelAbove)
  {
    std::vector<float> p(kChunk * ld);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks * segs; ++task) {
      const int64_t s = task % segs, hc = task / segs;
      const int64_t g = hc / chunks, h = g * group + hc % chunks * kChunk;
      const int c = static_cast<int>(std::min<int64_t>(kChunk, (g + 1) * group - h));
      const int64_t t0 = s * seg, len = std::min(n, t0 + seg) - t0;
      chunk_fn(c, d)(q + h * d, k + (g * stride + t0) * d, v + (g * stride + t0) * d, out + h * d, len, d, scale,
                     p.data(), ld, segs > 1 ? partials.data() + (h * segs + s) * pstride : nullptr, segs * pstride);
    }
    if (segs > 1) {
#pragma omp for schedule(static)
      for (int64_t h = 0; h < heads; ++h) merge(partials.data() + h * segs * pstride, segs, pstride, d, out + h * d);
    }
  }
}

// One token's K and V, token-major [kv_heads, d], stored at their position in a head-major
// cache: k_at / v_at point at head 0 of that position, heads are `stride` positions apart.
extern "C" void kv_store_row_bf16_cpu(const uint16_t *k_row, const uint16_t *v_row, uint16_t *k_at, uint16_t *v_at,
                                      int64_t kv_heads, int64_t d, int64_t stride) {
  for (int64_t g = 0; g < kv_heads; ++g) {
    std::memcpy(k_at + g * stride * d, k_row + g * d, d * sizeof(uint16_t));
    std::memcpy(v_at + g * stride * d, v_row + g * d, d * sizeof(uint16_t));
  }
}

// The same attention over positions 0..*pos of a resident cache (k, v: [kv_heads, stride, d];
// shape: heads, kv_heads, d, stride), the position read when the call runs, so one bound call
// serves every token; a position outside the cache reads and writes nothing and sets *status.
extern "C" void attention_at_bf16_cpu(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                      const int32_t *pos, const int64_t *shape, int32_t *status) {
  const int64_t n = static_cast<int64_t>(*pos) + 1, stride = shape[3];
  if (n < 1 || n > stride) {
    *status = 1;
    return;
  }
  *status = 0;
  attention_bf16_cpu(q, k, v, out, shape[0], shape[1], shape[2], n, stride);
}
