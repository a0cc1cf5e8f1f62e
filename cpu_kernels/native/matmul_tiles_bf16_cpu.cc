// Prefill's GEMM on AMX tiles (tiles_bf16.h) for the libraries that have them: C[m][n] =
// A[m][k] · Wᵀ with W from a BlockSource (the packed tiles of packed_tiles.h, or Q4NX dequantized
// by q4nx_blocks.h), each output rounded to bf16 once.
//
// A decoded weight block is already the B operand TDPBF16PS reads: K-pair p of block j is row p
// of a tile 16 outputs wide, each 32-bit element a (k even, k odd) pair. So a thread decodes a
// panel of blocks into its buffer once, and every 32 rows of A then run over it as a 2 x 2 grid
// of 16 x 16 accumulator tiles (tmm0-3), fed per 16 K-pairs by two A tiles loaded straight
// from A's rows (tmm4-5) and two B tiles from the panel (tmm6-7). The panel is as wide as fits
// in about 512 KiB (2 to 8 blocks), so a 32-row slab of A is reused from cache across it.
//
// Rows past the end of A are padded with zeros in one buffer rather than read; K must be
// a whole number of 16-pair steps (every Llama and SmolLM2 projection is), otherwise the caller
// uses the vector GEMM. Without tiles in the build, tiles_gemm returns false.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tiles_bf16.h"

namespace native {

#if NATIVE_TILES

namespace {

constexpr int64_t kLanes = packed::kLanes;
static_assert(kLanes * 4 == tiles::kRowBytes, "a weight block is one tile wide");
constexpr int64_t kSlab = 2 * tiles::kRows;           // rows of A per pass
constexpr int64_t kPanelBytes = 512 * 1024;

// 32 rows (from `a`, row stride lda elements) against blocks j, j + 1 of the panel: four
// accumulator tiles over all K, stored as f32 to `sums` ([4][16][16]).
void slab_pair(const uint16_t *a, int64_t lda, const uint32_t *b0, const uint32_t *b1, int64_t kp, float *sums) {
  TILE_ZERO(0);
  TILE_ZERO(1);
  TILE_ZERO(2);
  TILE_ZERO(3);
  const int64_t stride = lda * 2;
  for (int64_t p = 0; p < kp; p += tiles::kPairs) {
    TILE_LOAD(4, a + 2 * p, stride);
    TILE_LOAD(5, a + tiles::kRows * lda + 2 * p, stride);
    TILE_LOAD(6, b0 + p * kLanes, tiles::kRowBytes);
    TILE_LOAD(7, b1 + p * kLanes, tiles::kRowBytes);
    TILE_DOT(0, 4, 6);
    TILE_DOT(1, 4, 7);
    TILE_DOT(2, 5, 6);
    TILE_DOT(3, 5, 7);
  }
  constexpr int64_t kTile = tiles::kRows * kLanes;
  TILE_STORE(0, sums, tiles::kRowBytes);
  TILE_STORE(1, sums + kTile, tiles::kRowBytes);
  TILE_STORE(2, sums + 2 * kTile, tiles::kRowBytes);
  TILE_STORE(3, sums + 3 * kTile, tiles::kRowBytes);
}

}  // namespace

bool tiles_gemm(const uint16_t *a, const BlockSource &w, uint16_t *c, int64_t m, int64_t n, int64_t k) {
  const int64_t kp = k / 2, blocks = n / kLanes;
  if (kp % tiles::kPairs != 0 || m <= 0) return false;
  const int64_t per_panel = std::clamp<int64_t>(kPanelBytes / (kp * tiles::kRowBytes) / 2 * 2, 2, 8);
  const int64_t panels = (blocks + per_panel - 1) / per_panel;
  // The prompt's last rows, padded to a whole slab once for every panel and thread to read.
  const int64_t full = m / kSlab * kSlab;
  std::vector<uint16_t> tail(m > full ? kSlab * k : 0, 0);
  if (m > full) std::memcpy(tail.data(), a + full * k, (m - full) * k * sizeof(uint16_t));
#pragma omp parallel
  {
    // One spare block of zeros, for the second B tile of a panel with an odd block count.
    std::vector<uint32_t> panel((per_panel + 1) * kp * kLanes, 0);
    alignas(64) float sums[4][tiles::kRows][kLanes];
    tiles::configure();
#pragma omp for schedule(static)
    for (int64_t pn = 0; pn < panels; ++pn) {
      const int64_t b = pn * per_panel, nb = std::min(per_panel, blocks - b);
      for (int64_t j = 0; j < nb; ++j) w.decode(b + j, panel.data() + j * kp * kLanes);
      if (nb % 2) std::fill(panel.begin() + nb * kp * kLanes, panel.begin() + (nb + 1) * kp * kLanes, 0u);
      for (int64_t r = 0; r < m; r += kSlab) {
        const int64_t rows = std::min(kSlab, m - r);
        const uint16_t *src = r < full ? a + r * k : tail.data();
        for (int64_t j = 0; j < nb; j += 2) {
          slab_pair(src, k, panel.data() + j * kp * kLanes, panel.data() + (j + 1) * kp * kLanes, kp, &sums[0][0][0]);
          for (int half = 0; half < 2; ++half)
            for (int64_t i = 0; i < tiles::kRows && half * tiles::kRows + i < rows; ++i)
              for (int64_t jj = 0; jj < 2 && j + jj < nb; ++jj)
                native::store_bf16(c + (r + half * tiles::kRows + i) * n + (b + j + jj) * kLanes,
                                   native::load_f32(sums[2 * half + jj][i]));
        }
      }
    }
    tiles::release();
  }
  return true;
}

// One TDPBF16PS on the caller's tiles: c [16][16] f32 += a [16][32] bf16 · b [16 K-pairs][16
// pairs]; for tests that hold the tile step itself (real or emulated) to the SDM, to the bit.
extern "C" int tiles_dot_bf16_cpu(const uint16_t *a, const uint32_t *b, float *c) {
  tiles::configure();
  TILE_LOAD(0, c, tiles::kRowBytes);
  TILE_LOAD(4, a, tiles::kRowBytes);
  TILE_LOAD(6, b, tiles::kRowBytes);
  TILE_DOT(0, 4, 6);
  TILE_STORE(0, c, tiles::kRowBytes);
  tiles::release();
  return 1;
}

#else

extern "C" int tiles_dot_bf16_cpu(const uint16_t *, const uint32_t *, float *) { return 0; }

bool tiles_gemm(const uint16_t *, const BlockSource &, uint16_t *, int64_t, int64_t, int64_t) { return false; }

#endif

}  // namespace native

NATIVE_DEFINE_ISA_PROBES
