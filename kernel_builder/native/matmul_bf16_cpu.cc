// The simulated NPU's matrix products on the host CPU: prefill's GEMMs and decode's GEMVs, bf16
// operands, f32 accumulation, each output rounded to bf16 once (nearest-even).
//
// Both read weights in one tiled layout, which the simulated device keeps for every weight
// matrix W[N][K] it holds: [N/16][K/2][16][2]. Element (n, k) sits in block n/16, pair k/2,
// lane n%16, half k%2. AVX512-BF16's dot-product instruction multiplies 16 bf16 pairs by 16
// others and adds each product pair to its own f32 sum, so one 64-byte load of a block's pair
// and one broadcast pair of the activation advance 16 outputs at once: no horizontal sums,
// and the weights of 16 outputs are one sequential stream.
//
// - GEMV (decode, memory-bound): each thread streams whole blocks, in chunks of about 1 MiB
//   scheduled dynamically, so a batch (Q/K/V, gate and up, the LM head's partitions) ends
//   balanced. It reads as fast as the row-major kernel it replaced, or slightly faster.
// - GEMM (prefill, compute-bound): an 8-row by 32-column register tile, 16 f32 accumulators
//   fed by 2 weight loads and 8 activation broadcasts per pair. On the checkpoint's row-major
//   layout a GEMM has to repack weights on every call (oneDNN does) or broadcast from 8 strided
//   rows; here the tile streams them as stored, which measured 5-15 % faster than oneDNN's
//   GEMM on 128-2048 rows, and up to 35 % on 32.
// Built with -fopenmp: the library binds to the libgomp torch has loaded, one thread team.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_bf16.h"

namespace {

constexpr int64_t kLanes = 16;   // outputs per tile block
constexpr int kRows = 8;         // GEMM tile: activation rows
constexpr int kVecs = 2;         // GEMM tile: blocks of 16 outputs

inline __m512bh pair(const uint32_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh bcast(uint32_t v) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(v)); }

// ---- GEMV -----------------------------------------------------------------------------------

struct Job {
  const uint32_t *w;   // tiled
  const uint32_t *x;   // K/2 pairs
  uint16_t *y;
  int64_t n, k;
};

// One block: 16 outputs over all K, four sums in flight to cover the instruction's latency.
void gemv_block(const uint32_t *w, const uint32_t *x, int64_t kp, uint16_t *y) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t p = 0;
  for (; p + 4 <= kp; p += 4) {
    s0 = _mm512_dpbf16_ps(s0, pair(w + (p + 0) * kLanes), bcast(x[p + 0]));
    s1 = _mm512_dpbf16_ps(s1, pair(w + (p + 1) * kLanes), bcast(x[p + 1]));
    s2 = _mm512_dpbf16_ps(s2, pair(w + (p + 2) * kLanes), bcast(x[p + 2]));
    s3 = _mm512_dpbf16_ps(s3, pair(w + (p + 3) * kLanes), bcast(x[p + 3]));
  }
  for (; p < kp; ++p) s0 = _mm512_dpbf16_ps(s0, pair(w + p * kLanes), bcast(x[p]));
  native::store_bf16(y, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)), 0xffff);
}

// About 1 MiB of weights per chunk: long enough for the prefetchers to ramp up on each stream,
// still dozens of chunks per batch for the dynamic schedule to balance.
constexpr int64_t kChunkBytes = 1024 * 1024;

struct Chunk {
  int job;
  int64_t b0, b1;   // blocks
};

// ---- GEMM -----------------------------------------------------------------------------------

// C[R rows][V blocks of 16] = A[R rows] · W[V blocks]ᵀ over all K, accumulated in registers.
template <int R, int V>
void gemm_tile(const uint32_t *a, int64_t kp, const uint32_t *w, uint16_t *c, int64_t ldc) {
  __m512 acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh b[V];
    for (int j = 0; j < V; ++j) b[j] = pair(w + (j * kp + p) * kLanes);
    for (int i = 0; i < R; ++i) {
      const __m512bh x = bcast(a[i * kp + p]);
      for (int j = 0; j < V; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], b[j], x);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) native::store_bf16(c + i * ldc + j * kLanes, acc[i][j], 0xffff);
}

template <int V>
void gemm_rows(const uint32_t *a, int64_t m, int64_t kp, const uint32_t *w, uint16_t *c, int64_t ldc) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) gemm_tile<kRows, V>(a + r * kp, kp, w, c + r * ldc, ldc);
  const uint32_t *ar = a + r * kp;
  uint16_t *cr = c + r * ldc;
  switch (m - r) {   // the last rows of a prompt that is not a multiple of the tile
    case 7: gemm_tile<7, V>(ar, kp, w, cr, ldc); break;
    case 6: gemm_tile<6, V>(ar, kp, w, cr, ldc); break;
    case 5: gemm_tile<5, V>(ar, kp, w, cr, ldc); break;
    case 4: gemm_tile<4, V>(ar, kp, w, cr, ldc); break;
    case 3: gemm_tile<3, V>(ar, kp, w, cr, ldc); break;
    case 2: gemm_tile<2, V>(ar, kp, w, cr, ldc); break;
    case 1: gemm_tile<1, V>(ar, kp, w, cr, ldc); break;
    default: break;
  }
}

}  // namespace

extern "C" int matmul_bf16_cpu_supported() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

extern "C" int64_t matmul_bf16_cpu_tile_rows() { return kLanes; }

// Row-major W[n][k] into the tiled layout (n a multiple of 16, k even); t may be w itself. A block
// of 16 rows occupies the same bytes in both layouts, so each is staged through a small buffer
// and written back in place: a weight is tiled without a second copy of it.
extern "C" void tile_weight_bf16_cpu(const uint16_t *w, uint16_t *t, int64_t n, int64_t k) {
  const int64_t kp = k / 2, block = kLanes * kp;
  const uint32_t *src = reinterpret_cast<const uint32_t *>(w);
  uint32_t *dst = reinterpret_cast<uint32_t *>(t);
#pragma omp parallel
  {
    std::vector<uint32_t> rows(block);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n / kLanes; ++b) {
      std::memcpy(rows.data(), src + b * block, block * sizeof(uint32_t));
      uint32_t *out = dst + b * block;
      for (int64_t p = 0; p < kp; ++p)
        for (int64_t l = 0; l < kLanes; ++l) out[p * kLanes + l] = rows[l * kp + p];
    }
  }
}

// n independent GEMVs on tiled weights, each described by 5 int64 slots: w, x, y (addresses), n (rows), k.
extern "C" void gemv_tiled_bf16_cpu_batch(const int64_t *desc, int count) {
  std::vector<Job> jobs(count);
  std::vector<Chunk> chunks;
  for (int i = 0; i < count; ++i) {
    const int64_t *d = desc + 5 * i;
    jobs[i] = {reinterpret_cast<const uint32_t *>(d[0]), reinterpret_cast<const uint32_t *>(d[1]),
               reinterpret_cast<uint16_t *>(d[2]), d[3], d[4]};
    const int64_t blocks = d[3] / kLanes;
    int64_t step = kChunkBytes / (kLanes * d[4] * 2);
    step = step < 1 ? 1 : step;
    for (int64_t b = 0; b < blocks; b += step) chunks.push_back({i, b, b + step < blocks ? b + step : blocks});
  }
  const int64_t total = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < total; ++c) {
    const Job &j = jobs[chunks[c].job];
    const int64_t kp = j.k / 2;
    for (int64_t b = chunks[c].b0; b < chunks[c].b1; ++b) gemv_block(j.w + b * kp * kLanes, j.x, kp, j.y + b * kLanes);
  }
}

// C[m][n] = A[m][k] · Wᵀ with W tiled; A and C row-major. Threads split the columns.
extern "C" void gemm_tiled_bf16_cpu(const uint16_t *a, const uint16_t *w, uint16_t *c, int64_t m, int64_t n,
                                    int64_t k) {
  const int64_t kp = k / 2, blocks = n / kLanes, panels = (blocks + kVecs - 1) / kVecs;
  const uint32_t *a32 = reinterpret_cast<const uint32_t *>(a);
  const uint32_t *w32 = reinterpret_cast<const uint32_t *>(w);
#pragma omp parallel for schedule(static)
  for (int64_t pn = 0; pn < panels; ++pn) {
    const int64_t b = pn * kVecs;
    const uint32_t *wp = w32 + b * kp * kLanes;
    if (blocks - b >= kVecs)
      gemm_rows<kVecs>(a32, m, kp, wp, c + b * kLanes, n);
    else
      gemm_rows<1>(a32, m, kp, wp, c + b * kLanes, n);
  }
}
