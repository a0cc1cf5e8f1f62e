// y = A x in f32 over a matrix far larger than any cache: the machine's streaming read rate.
//
// This is the decode bound's denominator, so it must reach what the memory system delivers,
// not what a library's GEMV happens to reach (OpenBLAS and torch stop well short on the hosts
// this runs on). OpenMP splits the rows statically over every core and each core takes one
// row at a time, so it reads its own contiguous slab as a single sequential stream: that is
// what keeps the hardware prefetchers saturated. Interleaving rows to share loads of x, or
// rows so long that x falls out of L1, measured a quarter to a third slower.
#include <immintrin.h>

#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

extern "C" int gemv_f32_stream_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Columns k must be a multiple of 32 (the caller shapes the matrix).
extern "C" void gemv_f32_stream(const float *a, const float *x, float *y, int64_t m, int64_t k) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    const float *row = a + r * k;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    for (int64_t i = 0; i < k; i += 32) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(x + i), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(row + i + 16), _mm512_loadu_ps(x + i + 16), s1);
    }
    y[r] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  }
}
