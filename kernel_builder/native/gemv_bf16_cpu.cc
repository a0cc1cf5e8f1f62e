// y = W x in bf16 with f32 accumulation, for the simulated NPU's decode GEMVs on the host CPU.
//
// torch's bf16 matrix-vector product is compute-bound on CPUs without AMX (it widens to f32
// element by element), so decode would run at a fraction of memory bandwidth. AVX512-BF16's
// dot-product instruction multiplies bf16 pairs and accumulates in f32 at full vector width,
// which makes the GEMV memory-bound, as it is on the NPU. Each row's sum is rounded to bf16
// once, nearest-even.
//
// A call takes a batch of independent GEMVs (Q/K/V of a layer, gate and up, the LM head's
// partitions) and splits all their rows into chunks scheduled dynamically over OpenMP
// threads: one parallel region per batch, balanced to the end. Built with -fopenmp, this
// library binds to the libgomp torch has already loaded (same soname), so the GEMVs and
// torch's own ops share one warm thread team instead of two teams spinning against each other.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Job {
  const uint16_t *w;
  const uint16_t *x;
  uint16_t *y;
  int64_t m, k;
};

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline __m512bh load(const uint16_t *p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// Rows longer than this many elements push x out of L1 while the weight streams through it, so
// x is prefetched back ahead of use. Below it, x stays resident and the prefetch only costs.
constexpr int64_t kPrefetchXAbove = 4096;
constexpr int64_t kPrefetchDistance = 512;

// One row at a time: each thread then reads one long sequential stream, which the hardware
// prefetchers follow at full speed. Interleaving several rows (sharing loads of x) measured a
// third slower, as the streams compete for the prefetchers.
template <bool kPrefetchX>
void rows(const Job &j, int64_t r0, int64_t r1) {
  const int64_t k = j.k, pairs = k / 64 * 64, full = k / 32 * 32;
  const __mmask32 tail = k == full ? 0 : static_cast<__mmask32>((1ull << (k - full)) - 1);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t *a = j.w + r * k;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    for (int64_t i = 0; i < pairs; i += 64) {
      if (kPrefetchX) _mm_prefetch(reinterpret_cast<const char *>(j.x + (i + kPrefetchDistance) % k), _MM_HINT_T0);
      s0 = _mm512_dpbf16_ps(s0, load(a + i, ~0u), load(j.x + i, ~0u));
      s1 = _mm512_dpbf16_ps(s1, load(a + i + 32, ~0u), load(j.x + i + 32, ~0u));
    }
    if (full != pairs) s0 = _mm512_dpbf16_ps(s0, load(a + pairs, ~0u), load(j.x + pairs, ~0u));
    if (tail) s1 = _mm512_dpbf16_ps(s1, load(a + full, tail), load(j.x + full, tail));
    j.y[r] = to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)));
  }
}

// About 1 MiB of weights per chunk: long enough for the prefetchers to ramp up on each stream,
// still dozens of chunks per batch for the dynamic schedule to balance.
constexpr int64_t kChunkBytes = 1024 * 1024;

struct Chunk {
  int job;
  int64_t r0, r1;
};

}  // namespace

extern "C" int gemv_bf16_cpu_supported() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// n independent GEMVs, each described by 5 int64 slots: w, x, y (addresses), m (rows), k.
extern "C" void gemv_bf16_cpu_batch(const int64_t *desc, int n) {
  std::vector<Job> jobs(n);
  for (int i = 0; i < n; ++i) {
    const int64_t *d = desc + 5 * i;
    jobs[i] = {reinterpret_cast<const uint16_t *>(d[0]), reinterpret_cast<const uint16_t *>(d[1]),
               reinterpret_cast<uint16_t *>(d[2]), d[3], d[4]};
  }
  std::vector<Chunk> chunks;
  for (int i = 0; i < n; ++i) {
    int64_t step = kChunkBytes / (jobs[i].k * 2);
    step = step < 1 ? 1 : step;
    for (int64_t r = 0; r < jobs[i].m; r += step) chunks.push_back({i, r, r + step < jobs[i].m ? r + step : jobs[i].m});
  }
  const int64_t count = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < count; ++c) {
    const Job &j = jobs[chunks[c].job];
    if (j.k > kPrefetchXAbove)
      rows<true>(j, chunks[c].r0, chunks[c].r1);
    else
      rows<false>(j, chunks[c].r0, chunks[c].r1);
  }
}
