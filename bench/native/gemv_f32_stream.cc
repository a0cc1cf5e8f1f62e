// y = A x in f32 over a matrix far larger than any cache: the machine's streaming read rate.
//
// This is the decode bound's denominator, so it must reach what the memory system delivers,
// not what a library's GEMV happens to reach (OpenBLAS and torch stop well short on the hosts
// this runs on). OpenMP splits the rows statically over every core and each core takes one
// row at a time, so it reads its own contiguous slab as a single sequential stream: that is
// what keeps the hardware prefetchers saturated. Interleaving rows to share loads of x, or
// rows so long that x falls out of L1, measured a quarter to a third slower.
//
// The hardware prefetchers alone are not the ceiling everywhere: on an Intel Xeon (family 6,
// model 207) asking for every line 2 KiB ahead into L2 read 9 % faster than not asking, as
// decode's own GEMVs do (stream_ahead_cpu.cc). So the pass can ask, with any hint, and the
// caller keeps whichever way reads fastest on its machine (bench/bandwidth.py).
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

namespace {

#ifdef __AVX512F__
using Vec = __m512;
constexpr int kWidth = 16;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma_at(const float *a, const float *x, Vec s) { return _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(x), s); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float total(Vec s) { return _mm512_reduce_add_ps(s); }
#else
using Vec = __m256;
constexpr int kWidth = 8;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma_at(const float *a, const float *x, Vec s) { return _mm256_fmadd_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(x), s); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float total(Vec s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif
// 128 bytes, two cache lines, per iteration on either ISA. Without prefetches the AVX2 build
// read about 10 % below the AVX-512 one on the Intel Xeon, with one line an iteration or two
// alike, so the AVX-512 build is the one used wherever it runs.
constexpr int kStep = 32;
constexpr int kVecs = kStep / kWidth;

// Hint < 0: no software prefetch. Otherwise every line `ahead` bytes on, with that locality.
template <int Hint>
void pass(const float *a, const float *x, float *y, int64_t m, int64_t k, int64_t ahead) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    const float *row = a + r * k;
    Vec s[kVecs];
    for (auto &v : s) v = zero();
    for (int64_t i = 0; i < k; i += kStep) {
      if constexpr (Hint >= 0) {
        // An integer address: past the matrix's end a prefetch must not be a pointer overflow.
        const uintptr_t at = reinterpret_cast<uintptr_t>(row + i) + ahead;
        for (int line = 0; line < kStep * 4; line += 64)
          _mm_prefetch(reinterpret_cast<const char *>(at + line), static_cast<_mm_hint>(Hint));
      }
      for (int v = 0; v < kVecs; ++v) s[v] = fma_at(row + i + v * kWidth, x + i + v * kWidth, s[v]);
    }
    for (int v = 1; v < kVecs; ++v) s[0] = add(s[0], s[v]);
    y[r] = total(s[0]);
  }
}

}  // namespace

// n calls, call c over rows start[c] .. start[c] + rows[c] - 1, one after another, each splitting
// its rows over the threads afresh: a decode step's GEMV dispatches stream their weights that
// way, each call starting both threads' streams anew and ending when the slower one is done
// (bench/bandwidth.py, `Stream.sample_calls`). The whole pass is one call over every row.
// Columns k must be a multiple of 32 (the caller shapes the matrix).
// hint: -1 none, else a prefetch locality (0 NTA, 2 T1, 3 T0) `ahead` bytes on. Returns 0, or
// -1 for a hint it does not know.
extern "C" int gemv_f32_stream(const float *a, const float *x, float *y, const int64_t *start, const int64_t *rows,
                               int64_t n, int64_t k, int hint, int64_t ahead) {
  void (*one)(const float *, const float *, float *, int64_t, int64_t, int64_t);
  switch (hint) {
    case -1: one = pass<-1>; break;
    case 0: one = pass<_MM_HINT_NTA>; break;
    case 2: one = pass<_MM_HINT_T1>; break;
    case 3: one = pass<_MM_HINT_T0>; break;
    default: return -1;
  }
  for (int64_t c = 0; c < n; ++c) one(a + start[c] * k, x, y + start[c], rows[c], k, ahead);
  return 0;
}
