// The simulated NPU's matrix products on the host CPU: prefill's GEMMs and decode's GEMVs, bf16
// operands, f32 accumulation, each output rounded to bf16 once (nearest-even).
//
// Both read weights in the packed tiles of packed_tiles.h, which the simulated device keeps for
// every weight matrix W[N][K] it holds. Decoded, a unit is two tile vectors of the layout
// [N/16][K/2][16][2]: element (n, k) in block n/16, pair k/2, lane n%16, half k%2. A pair dot
// step (simd_bf16.h: AVX512-BF16's vdpbf16ps, or two FMAs: `avx512`, AVX2) multiplies 16 bf16
// pairs by 16 others and adds each product pair to its own f32 sum, so one tile vector and one
// broadcast pair of the activation advance 16 outputs at once: no horizontal sums, and the
// weights of 16 outputs are one sequential stream.
//
// - GEMV (decode, memory-bound): each thread decodes whole blocks as they stream in, reading
//   its own contiguous share of the batch (Q/K/V, gate and up, the LM head's partitions) and
//   then helping with the others' (stream_split.h), so the batch ends balanced. It reads 3/4
//   of the bytes a bf16 GEMV reads, and decoding keeps pace with memory, so it runs about 4/3
//   as fast where memory is the limit.
// - GEMM (prefill, compute-bound): on AVX-512 an 8-row by 32-column register tile, 16 f32
//   accumulators fed by 2 weight vectors and 8 activation broadcasts per pair; AVX2 has half the
//   registers at half the width, so 4 rows by 16 columns (8 accumulators of 8 floats, 4 widened
//   weight halves). A panel of outputs is decoded
//   by its first row tile, as it streams in, into a thread's buffer (at most 512 KiB, within
//   its L2) that the panel's other row tiles read. On the
//   checkpoint's row-major layout a GEMM has to repack weights on every call (oneDNN does) or
//   broadcast from 8 strided rows; the tile streams them as stored (docs/profile.md compares
//   the two).
// Built with -fopenmp: the library binds to the libgomp torch has loaded, one thread team.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "packed_tiles.h"
#include "q4nx_blocks.h"
#include "replayed.h"
#include "simd_bf16.h"
#include "stream_split.h"
#include "tiles_bf16.h"

namespace {

namespace nv = native;

constexpr int64_t kLanes = packed::kLanes;   // outputs per tile block
static_assert(kLanes == nv::kWidth, "a tile block's sums are one vector");
#if NATIVE_AVX512
constexpr int kRows = 8;                     // GEMM tile: activation rows
constexpr int kVecs = 2;                     // GEMM tile: blocks of 16 outputs
#else
constexpr int kRows = 4;
constexpr int kVecs = 1;
#endif

// The activations as the dot steps read them: bf16 pairs as stored, or, where the pair dot is
// two FMAs (simd_bf16.h's `avx512` class), each pair widened to two floats once per call, so
// that a broadcast from memory costs no arithmetic: widened in registers, each of a GEMM tile's
// 8 rows spent two instructions a pair beside its 4 FMAs, and the GEMM ran at 1.23x vdpbf16ps
// on a Xeon (family 6, model 207) where the floats from memory ran at 1.77x.
#if NATIVE_DOT_FMA
using Pairs = const float *;
constexpr int64_t kPairWords = 2;
inline nv::X2 pair_at(Pairs a, int64_t i) { return nv::bcast_f32(a + 2 * i); }
#else
using Pairs = const uint32_t *;
constexpr int64_t kPairWords = 1;
inline nv::X2 pair_at(Pairs a, int64_t i) { return nv::bcast_pair(a[i]); }
#endif

#if NATIVE_DOT_FMA
// dst[i] = src[i] as f32, for i < n: a bf16 is the top half of its f32.
inline void widen_bf16(const uint16_t *src, int64_t n, float *dst) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}
#endif

// At most this many bytes of A are widened at a time: a 2048-row prompt's 8192-column rows
// would take 64 MiB at once.
constexpr int64_t kWidenBytes = 16 << 20;

// body(rows, r0, count) for consecutive chunks of A's m rows (k columns), `rows` in Pairs form:
// A itself, or its rows widened to f32 by the team, chunk by chunk.
template <class Body>
void over_row_chunks(const uint16_t *a, int64_t m, int64_t k, Body body) {
#if NATIVE_DOT_FMA
  const int64_t chunk = std::max<int64_t>(kRows, kWidenBytes / (4 * k) / kRows * kRows);
  std::vector<float> wide(std::min(chunk, m) * k);
  for (int64_t r0 = 0; r0 < m; r0 += chunk) {
    const int64_t rows = std::min(chunk, m - r0);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) widen_bf16(a + (r0 + r) * k, k, wide.data() + r * k);
    body(static_cast<Pairs>(wide.data()), r0, rows);
  }
#else
  (void)k;
  body(reinterpret_cast<Pairs>(a), int64_t{0}, m);
#endif
}

// ---- GEMV -----------------------------------------------------------------------------------

struct Job {
  packed::View w;
  Pairs x;   // K/2 pairs
  uint16_t *y;
};

// One block: 16 outputs over all K, four sums in flight (K-pair p into sum p % 4, a last odd
// unit into the first) to cover the instruction's latency.
void gemv_block(const packed::View &w, int64_t blk, Pairs x, uint16_t *y, nv::Ahead ahead) {
  nv::F16 s0 = nv::zero(), s1 = s0, s2 = s0, s3 = s0;
  packed::Cursor cur(w, blk);
  nv::P16 a, b;
  int64_t u = 0;
  for (; u + 2 <= w.u; u += 2) {
    nv::prefetch_ahead(cur.c + u * packed::kUnitBytes, 2 * packed::kUnitBytes, ahead);
    cur.unit(u, a, b);
    s0 = nv::dot(s0, nv::widen(a), pair_at(x, 2 * u));
    s1 = nv::dot(s1, nv::widen(b), pair_at(x, 2 * u + 1));
    cur.unit(u + 1, a, b);
    s2 = nv::dot(s2, nv::widen(a), pair_at(x, 2 * u + 2));
    s3 = nv::dot(s3, nv::widen(b), pair_at(x, 2 * u + 3));
  }
  if (u < w.u) {
    cur.unit(u, a, b);
    s0 = nv::dot(s0, nv::widen(a), pair_at(x, 2 * u));
    s0 = nv::dot(s0, nv::widen(b), pair_at(x, 2 * u + 1));
  }
  nv::store_bf16(y, nv::add(nv::add(s0, s1), nv::add(s2, s3)));
}

// ---- GEMM -----------------------------------------------------------------------------------

// C[R rows][V blocks of 16] = A[R rows] · W[V blocks]ᵀ over all K, accumulated in registers.
template <int R, int V>
void gemm_tile(Pairs a, int64_t kp, const uint32_t *w, uint16_t *c, int64_t ldc) {
  nv::F16 acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) acc[i][j] = nv::zero();
  for (int64_t p = 0; p < kp; ++p) {
    nv::W16 b[V];
    for (int j = 0; j < V; ++j) b[j] = nv::widen(nv::load_pairs(w + (j * kp + p) * kLanes));
    for (int i = 0; i < R; ++i) {
      const nv::X2 x = pair_at(a, i * kp + p);
      for (int j = 0; j < V; ++j) acc[i][j] = nv::dot(acc[i][j], b[j], x);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) nv::store_bf16(c + i * ldc + j * kLanes, acc[i][j]);
}

// The first tile of rows over a panel of V packed blocks: the same sums as gemm_tile, reading
// the weights as they stream in from memory, and leaving them decoded in `panel` for the
// panel's other rows. Streaming stays behind the tile's arithmetic, as with unpacked weights.
template <int R, int V>
void gemm_tile_unpacking(Pairs a, int64_t kp, const packed::View &w, int64_t blk, uint32_t *panel,
                         uint16_t *c, int64_t ldc) {
  nv::F16 acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) acc[i][j] = nv::zero();
  packed::Cursor cur[V];
  for (int j = 0; j < V; ++j) cur[j] = packed::Cursor(w, blk + j);
  for (int64_t u = 0; u < w.u; ++u) {
    nv::W16 lo[V], hi[V];
    for (int j = 0; j < V; ++j) {
      nv::P16 a0, a1;
      cur[j].unit(u, a0, a1);
      nv::store_pairs(panel + (j * kp + 2 * u) * kLanes, a0);
      nv::store_pairs(panel + (j * kp + 2 * u + 1) * kLanes, a1);
      lo[j] = nv::widen(a0);
      hi[j] = nv::widen(a1);
    }
    for (int i = 0; i < R; ++i) {
      const nv::X2 x0 = pair_at(a, i * kp + 2 * u), x1 = pair_at(a, i * kp + 2 * u + 1);
      for (int j = 0; j < V; ++j) {
        acc[i][j] = nv::dot(acc[i][j], lo[j], x0);
        acc[i][j] = nv::dot(acc[i][j], hi[j], x1);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < V; ++j) nv::store_bf16(c + i * ldc + j * kLanes, acc[i][j]);
}

// Rows r0.. of A against a panel of V blocks already decoded into `panel`.
template <int V>
void gemm_plain_rows(Pairs a, int64_t r0, int64_t m, int64_t kp, const uint32_t *panel, uint16_t *c,
                     int64_t ldc) {
  int64_t r = r0;
  for (; r + kRows <= m; r += kRows) gemm_tile<kRows, V>(a + r * kp * kPairWords, kp, panel, c + r * ldc, ldc);
  const Pairs ar = a + r * kp * kPairWords;
  uint16_t *cr = c + r * ldc;
  switch (m > r ? m - r : 0) {   // the last rows of a prompt that is not a multiple of the tile
    case 7: gemm_tile<7, V>(ar, kp, panel, cr, ldc); break;
    case 6: gemm_tile<6, V>(ar, kp, panel, cr, ldc); break;
    case 5: gemm_tile<5, V>(ar, kp, panel, cr, ldc); break;
    case 4: gemm_tile<4, V>(ar, kp, panel, cr, ldc); break;
    case 3: gemm_tile<3, V>(ar, kp, panel, cr, ldc); break;
    case 2: gemm_tile<2, V>(ar, kp, panel, cr, ldc); break;
    case 1: gemm_tile<1, V>(ar, kp, panel, cr, ldc); break;
    default: break;
  }
}

// Rows of A against a panel of V blocks: the first tile unpacks the panel into `panel`, the
// rest read it from there (a thread's L2).
template <int V>
void gemm_rows(Pairs a, int64_t m, int64_t kp, const packed::View &w, int64_t blk, uint32_t *panel,
               uint16_t *c, int64_t ldc) {
  switch (m < kRows ? m : kRows) {
    case 8: gemm_tile_unpacking<8, V>(a, kp, w, blk, panel, c, ldc); break;
    case 7: gemm_tile_unpacking<7, V>(a, kp, w, blk, panel, c, ldc); break;
    case 6: gemm_tile_unpacking<6, V>(a, kp, w, blk, panel, c, ldc); break;
    case 5: gemm_tile_unpacking<5, V>(a, kp, w, blk, panel, c, ldc); break;
    case 4: gemm_tile_unpacking<4, V>(a, kp, w, blk, panel, c, ldc); break;
    case 3: gemm_tile_unpacking<3, V>(a, kp, w, blk, panel, c, ldc); break;
    case 2: gemm_tile_unpacking<2, V>(a, kp, w, blk, panel, c, ldc); break;
    case 1: gemm_tile_unpacking<1, V>(a, kp, w, blk, panel, c, ldc); break;
    default: return;
  }
  gemm_plain_rows<V>(a, kRows, m, kp, panel, c, ldc);
}

// The packed tiles as a BlockSource, for the tile GEMM (which decodes whole panels first).
struct PackedSource final : nv::BlockSource {
  packed::View w;
  explicit PackedSource(const uint8_t *p) : w(p) {}
  void decode(int64_t blk, uint32_t *out) const override {
    packed::Cursor cur(w, blk);
    nv::P16 a, b;
    for (int64_t u = 0; u < w.u; ++u) {
      cur.unit(u, a, b);
      nv::store_pairs(out + 2 * u * kLanes, a);
      nv::store_pairs(out + (2 * u + 1) * kLanes, b);
    }
  }
};

}  // namespace

extern "C" int64_t matmul_bf16_cpu_tile_rows() { return kLanes; }

extern "C" int64_t matmul_bf16_cpu_packed_header() { return packed::kHeader; }

// Independent GEMVs on packed weights, each described by 5 int64 slots: w, x, y (addresses), n (rows), k.
extern "C" void gemv_packed_bf16_cpu_batch(const int64_t *desc, int count) {
  std::vector<Job> jobs;
  jobs.reserve(count);
  std::vector<int64_t> blocks(count), block_bytes(count);
#if NATIVE_DOT_FMA
  // Each distinct activation vector widened once (Q, K and V share one, the head's partitions one).
  std::vector<std::vector<float>> wide;
  std::vector<const void *> wide_of;
  wide.reserve(count);
#endif
  for (int i = 0; i < count; ++i) {
    const int64_t *d = desc + 5 * i;
#if NATIVE_DOT_FMA
    const void *src = reinterpret_cast<const void *>(d[1]);
    const size_t at = std::find(wide_of.begin(), wide_of.end(), src) - wide_of.begin();
    if (at == wide_of.size()) {
      wide.emplace_back(d[4]);
      widen_bf16(static_cast<const uint16_t *>(src), d[4], wide.back().data());
      wide_of.push_back(src);
    }
    const Pairs x = wide[at].data();
#else
    const Pairs x = reinterpret_cast<Pairs>(d[1]);
#endif
    jobs.push_back({packed::View(reinterpret_cast<const uint8_t *>(d[0])), x, reinterpret_cast<uint16_t *>(d[2])});
    blocks[i] = d[3] / kLanes;
    block_bytes[i] = jobs.back().w.u * packed::kUnitBytes;   // escapes aside, which are rare
  }
  nv::StreamSplit split(blocks, block_bytes);
  const nv::Ahead ahead = nv::stream_ahead();
#pragma omp parallel
  {
    nv::hold_if_asked(split);
    split.run([&](int job, int64_t b) { gemv_block(jobs[job].w, b, jobs[job].x, jobs[job].y + b * kLanes, ahead); });
  }
}

// C[m][n] = A[m][k] · Wᵀ with W packed; A and C row-major. On AMX tiles where the library has
// them; otherwise threads split the columns into panels of kVecs blocks, each unpacked once
// into the thread's buffer by its first row tile.
extern "C" void gemm_packed_bf16_cpu(const uint16_t *a, const uint8_t *w, uint16_t *c, int64_t m, int64_t n,
                                     int64_t k) {
  const int64_t kp = k / 2, blocks = n / kLanes, panels = (blocks + kVecs - 1) / kVecs;
  const packed::View view(w);
  if (native::tiles_gemm(a, PackedSource(w), c, m, n, k)) return;
  over_row_chunks(a, m, k, [&](Pairs rows, int64_t r0, int64_t count) {
    uint16_t *cr = c + r0 * n;
#pragma omp parallel
    {
      std::vector<uint32_t> panel(kVecs * kp * kLanes);   // kVecs blocks of plain tiles
#pragma omp for schedule(static)
      for (int64_t pn = 0; pn < panels; ++pn) {
        const int64_t b = pn * kVecs;
        if (blocks - b >= kVecs)
          gemm_rows<kVecs>(rows, count, kp, view, b, panel.data(), cr + b * kLanes, n);
        else
          gemm_rows<1>(rows, count, kp, view, b, panel.data(), cr + b * kLanes, n);
      }
    }
  });
}

// C[m][n] = A[m][k] · Wᵀ with W in Q4NX, dequantized to bf16 as q4nx.dequantize does: on tiles
// where the library has them, else threads take panels of kVecs 16-row blocks, decode each into
// the thread's buffer once and run every row of A over it.
extern "C" void gemm_q4nx_cpu(const uint16_t *a, const uint8_t *w, uint16_t *c, int64_t m, int64_t n, int64_t k) {
  const int64_t kp = k / 2, blocks = n / kLanes, panels = (blocks + kVecs - 1) / kVecs;
  const q4nx::Source source(w, k);
  if (native::tiles_gemm(a, source, c, m, n, k)) return;
  over_row_chunks(a, m, k, [&](Pairs rows, int64_t r0, int64_t count) {
    uint16_t *cr = c + r0 * n;
#pragma omp parallel
    {
      std::vector<uint32_t> panel(kVecs * kp * kLanes);
#pragma omp for schedule(static)
      for (int64_t pn = 0; pn < panels; ++pn) {
        const int64_t b = pn * kVecs, nb = blocks - b < kVecs ? blocks - b : kVecs;
        for (int64_t j = 0; j < nb; ++j) source.decode(b + j, panel.data() + j * kp * kLanes);
        if (nb == kVecs)
          gemm_plain_rows<kVecs>(rows, 0, count, kp, panel.data(), cr + b * kLanes, n);
        else
          gemm_plain_rows<1>(rows, 0, count, kp, panel.data(), cr + b * kLanes, n);
      }
    }
  });
}
