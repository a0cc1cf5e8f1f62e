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

#include "replayed.h"
#include "simd_bf16.h"

namespace {

constexpr int64_t kParallelAbove = 1 << 16;   // elements; below this a parallel region costs more than it saves

namespace nv = native;
constexpr int64_t kW = nv::kWidth;

void rmsnorm_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t dim, float eps) {
  nv::F16 ss = nv::zero();
  for (int64_t i = 0; i < dim; i += kW) {
    const nv::F16 v = nv::load_bf16(x + i, dim - i);
    ss = nv::add(ss, nv::mul(v, v));
  }
  const float mean = nv::reduce_add(ss) / static_cast<float>(dim);
  const nv::F16 inv = nv::set1(1.0f / __builtin_sqrtf(mean + eps));
  // HF's rounding points (and the MLIR launch's): the normalised row is rounded to bf16, then
  // multiplied by the weight and rounded again. `out` holds the rounded row in between, so both
  // ISA builds share the one rounding `store_bf16` does; the row is in L1 for the second pass.
  for (int64_t i = 0; i < dim; i += kW)
    nv::store_bf16(out + i, nv::mul(nv::load_bf16(x + i, dim - i), inv), dim - i);
  for (int64_t i = 0; i < dim; i += kW)
    nv::store_bf16(out + i, nv::mul(nv::load_bf16(out + i, dim - i), nv::load_bf16(w + i, dim - i)), dim - i);
}

void swiglu_span(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n) {
  const nv::F16 one = nv::set1(1.0f);
  for (int64_t i = 0; i < n; i += kW) {
    const nv::F16 g = nv::load_bf16(gate + i, n - i);
    const nv::F16 silu = nv::div(g, nv::add(one, nv::exp_ps(nv::sub(nv::zero(), g))));
    nv::store_bf16(out + i, nv::mul(silu, nv::load_bf16(up + i, n - i)), n - i);
  }
}

void add_span(const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t n) {
  for (int64_t i = 0; i < n; i += kW) nv::store_bf16(out + i, nv::add(nv::load_bf16(a + i, n - i), nv::load_bf16(b + i, n - i)), n - i);
}

void rope_row(const uint16_t *x, const uint16_t *lut, uint16_t *out, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const uint16_t *xh = x + h * head_dim;
    uint16_t *oh = out + h * head_dim;
    for (int64_t i = 0; i < half; i += kW) {
      const int64_t left = half - i;
      const nv::F16 c = nv::load_bf16(lut + i, left), s = nv::load_bf16(lut + half + i, left);
      const nv::F16 x1 = nv::load_bf16(xh + i, left), x2 = nv::load_bf16(xh + half + i, left);
      nv::store_bf16(oh + i, nv::sub(nv::mul(x1, c), nv::mul(x2, s)), left);
      nv::store_bf16(oh + half + i, nv::add(nv::mul(x2, c), nv::mul(x1, s)), left);
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
