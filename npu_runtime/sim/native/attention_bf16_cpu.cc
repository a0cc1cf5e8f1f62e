// Single-query GQA attention over a head-major bf16 KV cache, f32 math: decode's host attention.
//
// One token's attention reads positions 0..pos of each KV head once; at short contexts torch
// spends far longer dispatching the widen / matmul / softmax / matmul chain than reading. Here
// each query head makes one pass for its scores and one for the weighted sum of V, with a
// max-subtracted softmax as torch's, over the KV head its group shares. Long contexts split
// the query heads over the OpenMP team.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_bf16.h"

namespace {

namespace nv = native;
constexpr int64_t kW = nv::kWidth;

constexpr int64_t kParallelAbove = 1 << 16;   // K elements read per head group
constexpr int64_t kMaxHeadDim = 256;

void one_head(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t n, int64_t d,
              float scale, float *scores) {
  nv::F16 qv[kMaxHeadDim / kW];
  const int64_t blocks = (d + kW - 1) / kW;
  for (int64_t b = 0; b < blocks; ++b) qv[b] = nv::load_bf16(q + kW * b, d - kW * b);
  float top = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t *kt = k + t * d;
    nv::F16 s = nv::zero();
    for (int64_t b = 0; b < blocks; ++b) s = nv::fma(qv[b], nv::load_bf16(kt + kW * b, d - kW * b), s);
    scores[t] = nv::reduce_add(s) * scale;
    top = scores[t] > top ? scores[t] : top;
  }
  nv::F16 total = nv::zero();
  const nv::F16 topv = nv::set1(top);
  for (int64_t t = 0; t < n; t += kW) {
    const nv::F16 e = nv::keep(nv::lanes_below(n - t), nv::exp_ps(nv::sub(nv::load_f32(scores + t, n - t), topv)));
    nv::store_f32(scores + t, e, n - t);
    total = nv::add(total, e);
  }
  const float inv = 1.0f / nv::reduce_add(total);
  nv::F16 acc[kMaxHeadDim / kW];
  for (int64_t b = 0; b < blocks; ++b) acc[b] = nv::zero();
  for (int64_t t = 0; t < n; ++t) {
    const nv::F16 p = nv::set1(scores[t]);
    const uint16_t *vt = v + t * d;
    for (int64_t b = 0; b < blocks; ++b) acc[b] = nv::fma(p, nv::load_bf16(vt + kW * b, d - kW * b), acc[b]);
  }
  for (int64_t b = 0; b < blocks; ++b) nv::store_bf16(out + kW * b, nv::mul(acc[b], nv::set1(inv)), d - kW * b);
}

}  // namespace

extern "C" int64_t attention_bf16_cpu_max_head_dim() { return kMaxHeadDim; }

// q, out: [heads, d]; k, v: [kv_heads, stride, d] (one layer of the cache), positions 0..n-1 read.
extern "C" void attention_bf16_cpu(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                                   int64_t heads, int64_t kv_heads, int64_t d, int64_t n, int64_t stride) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t group = heads / kv_heads;
#pragma omp parallel if (n * d * kv_heads > kParallelAbove)
  {
    std::vector<float> scores(n + 16);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / group;
      one_head(q + h * d, k + g * stride * d, v + g * stride * d, out + h * d, n, d, scale, scores.data());
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
