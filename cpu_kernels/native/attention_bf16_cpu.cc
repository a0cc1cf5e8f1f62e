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
// Beyond a few dozen positions the (KV head, chunk) pairs are split over the OpenMP team.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// C query heads (q: C rows of d) over positions 0..n-1 of one KV head; `p` holds C rows of `ld`
// floats for the probabilities. C and BL (head-dim blocks; 0: d's, known only at run time) are
// compile-time where they can be, so the sums of a row stay in registers.
template <int C, int BL>
void head_chunk(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t n, int64_t d,
                float scale, float *p, int64_t ld) {
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
  float inv[C];
  for (int h = 0; h < C; ++h) {
    float *ph = p + h * ld;
    const nv::F16 topv = nv::set1(nv::reduce_max(top[h]));
    nv::F16 total = nv::zero();
    for (int64_t t = 0; t < n; t += kW) {
      const nv::F16 e = nv::keep(nv::lanes_below(n - t), nv::exp_ps(nv::sub(nv::load_f32(ph + t, n - t), topv)));
      nv::store_f32(ph + t, e, n - t);
      total = nv::add(total, e);
    }
    inv[h] = 1.0f / nv::reduce_add(total);
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
  for (int h = 0; h < C; ++h)
    for (int64_t b = 0; b < blocks; ++b)
      nv::store_bf16(out + h * d + kW * b, nv::mul(acc[h][b], nv::set1(inv[h])), d - kW * b);
}

using ChunkFn = void (*)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, float,
                        float *, int64_t);

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
  const int64_t ld = (n + kW - 1) / kW * kW;   // whole blocks of scores
#pragma omp parallel if (n * d * kv_heads > kParallelAbove)
  {
    std::vector<float> p(kChunk * ld);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < kv_heads * chunks; ++task) {
      const int64_t g = task / chunks, h = g * group + task % chunks * kChunk;
      const int c = static_cast<int>(std::min<int64_t>(kChunk, (g + 1) * group - h));
      chunk_fn(c, d)(q + h * d, k + g * stride * d, v + g * stride * d, out + h * d, n, d, scale, p.data(), ld);
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
