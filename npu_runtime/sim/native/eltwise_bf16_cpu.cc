// The simulated NPU's elementwise launches (RMSNorm, SwiGLU, RoPE, add) on bf16 rows, f32 math.
//
// In decode each of these touches a single row of a few thousand elements, where torch's
// per-op dispatch and temporaries cost ten times the arithmetic and, interleaved with the
// GEMVs' streaming, most of a token's overhead. One pass per launch, no allocation, the
// operation order torch uses (compiled with -ffp-contract=off so no product is fused into an
// add), one nearest-even rounding to bf16 per output, as the reference kernels do. Large
// inputs (prefill) are split over the OpenMP team by rows.
#include <immintrin.h>

#include <cstdint>

#include "simd_bf16.h"

namespace {

constexpr int64_t kParallelAbove = 1 << 16;   // elements; below this a parallel region costs more than it saves

using native::exp_ps;
using native::lanes;
using native::load_bf16;
using native::store_bf16;

void rmsnorm_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t dim, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 v = load_bf16(x + i, lanes(dim - i));
    ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
  }
  const float mean = _mm512_reduce_add_ps(ss) / static_cast<float>(dim);
  const __m512 inv = _mm512_set1_ps(1.0f / __builtin_sqrtf(mean + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = lanes(dim - i);
    store_bf16(out + i, _mm512_mul_ps(_mm512_mul_ps(load_bf16(x + i, m), inv), load_bf16(w + i, m)), m);
  }
}

void swiglu_span(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 g = load_bf16(gate + i, m);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    store_bf16(out + i, _mm512_mul_ps(silu, load_bf16(up + i, m)), m);
  }
}

void add_span(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    store_bf16(out + i, _mm512_add_ps(load_bf16(a + i, m), load_bf16(b + i, m)), m);
  }
}

void rope_row(const uint16_t *x, const uint16_t *lut, uint16_t *out, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const uint16_t *xh = x + h * head_dim;
    uint16_t *oh = out + h * head_dim;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = lanes(half - i);
      const __m512 c = load_bf16(lut + i, m), s = load_bf16(lut + half + i, m);
      const __m512 x1 = load_bf16(xh + i, m), x2 = load_bf16(xh + half + i, m);
      store_bf16(oh + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)), m);
      store_bf16(oh + half + i, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)), m);
    }
  }
}

// out[i] = f(a[i], b[i]) over n elements, in spans split over the team when n is large.
template <typename Span>
void over_spans(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t n, Span span) {
  constexpr int64_t kSpan = 1 << 14;
  const int64_t spans = (n + kSpan - 1) / kSpan;
#pragma omp parallel for schedule(static) if (n > kParallelAbove)
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t i = s * kSpan;
    span(a + i, b + i, out + i, n - i < kSpan ? n - i : kSpan);
  }
}

}  // namespace

extern "C" void rmsnorm_bf16_cpu(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t dim,
                                 float eps) {
#pragma omp parallel for schedule(static) if (rows * dim > kParallelAbove)
  for (int64_t r = 0; r < rows; ++r) rmsnorm_row(x + r * dim, w, out + r * dim, dim, eps);
}

extern "C" void swiglu_bf16_cpu(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
  over_spans(gate, up, out, n, swiglu_span);
}

extern "C" void add_bf16_cpu(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t n) {
  over_spans(a, b, out, n, add_span);
}

// x and out are [rows, heads, head_dim]; lut is [rows, head_dim] = cos | sin of each row's position.
extern "C" void rope_bf16_cpu(const uint16_t *x, const uint16_t *lut, uint16_t *out, int64_t rows, int64_t heads,
                              int64_t head_dim) {
#pragma omp parallel for schedule(static) if (rows * heads * head_dim > kParallelAbove)
  for (int64_t r = 0; r < rows; ++r)
    rope_row(x + r * heads * head_dim, lut + r * head_dim, out + r * heads * head_dim, heads, head_dim);
}
