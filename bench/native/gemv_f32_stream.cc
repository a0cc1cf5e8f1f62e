// y = A x in f32 over a matrix far larger than any cache: the machine's streaming read rate.
//
// This is the decode bound's denominator, so it must reach what the memory system delivers,
// not what a library's GEMV happens to reach (OpenBLAS and torch stop well short on the hosts
// this runs on). Four rows share each load of x, so the loop issues almost only loads of A,
// and OpenMP splits the rows statically over every core: each core streams its own
// contiguous slab, which is what keeps the hardware prefetchers saturated.
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

// Rows m must be a multiple of 4 and columns k a multiple of 16 (the caller shapes the matrix).
extern "C" void gemv_f32_stream(const float *a, const float *x, float *y, int64_t m, int64_t k) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; r += 4) {
    const float *r0 = a + r * k, *r1 = r0 + k, *r2 = r1 + k, *r3 = r2 + k;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 xv = _mm512_loadu_ps(x + i);
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(r0 + i), xv, s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(r1 + i), xv, s1);
      s2 = _mm512_fmadd_ps(_mm512_loadu_ps(r2 + i), xv, s2);
      s3 = _mm512_fmadd_ps(_mm512_loadu_ps(r3 + i), xv, s3);
    }
    y[r] = _mm512_reduce_add_ps(s0);
    y[r + 1] = _mm512_reduce_add_ps(s1);
    y[r + 2] = _mm512_reduce_add_ps(s2);
    y[r + 3] = _mm512_reduce_add_ps(s3);
  }
}
