// Decode's fused dequantize-and-multiply (FusedDQP) for one Q4NX block of one row-block:
//   acc[r] += sum over the block's columns j of w[r][j] * x[col0 + j],   r < ROWS,
// with w = q * scale + min never formed. `blk` holds the block (`cols` <= GEMV_Q4NX_TILE_K
// columns; the layout is in q4nx.h), `x` the whole input vector, `acc` the row-block's f32
// sums, which the caller zeroes before its first block and rounds after its last.
//
// Numerics, both paths: per group of GROUP columns,
//   dot[r] = sum_j q[r][j] * x[j]   in f32 (each product is exact: a 4-bit integer times a bf16),
//   xs     = sum_j x[j]             in f32,
//   acc[r] += scale[r] * dot[r] + min[r] * xs   (two products and two sums, each rounded to f32).
// The decode contract (llama_base.q4nx.gemv_reference) sums q times a 16-bit fixed point of x,
// exactly; this differs from it by that fixed point's rounding of the small x of a group (under
// 2^-15 of the group's largest |x|) and by f32 summation order. The host path sums columns in
// order; the AIE path keeps 16 rows per accumulator lane and sums a column at a time too.
//
// Defines: Q4NX_ROWS, Q4NX_COLS, Q4NX_GROUP (the format), GEMV_Q4NX_TILE_K (the block buffer's
// columns), GEMV_Q4NX_K (x's length), GEMV_Q4NX_SYMBOL (the exported name).
#include "q4nx.h"

namespace {

using namespace q4nx;

constexpr int TILE_K = GEMV_Q4NX_TILE_K;
constexpr int K = GEMV_Q4NX_K;
static_assert(TILE_K % GROUP == 0 && K % GROUP == 0, "blocks are whole groups");

#if defined(__AIENGINE__)

// One column's ROWS values as two bf16 vectors: rows [0, HALF) are the low nibbles of its bytes,
// rows [HALF, ROWS) the high ones (small integers: exact in bf16).
static inline void column(const uint8_t *p, aie::vector<bf16, HALF> &lo, aie::vector<bf16, HALF> &hi) {
  aie::vector<uint8, HALF> bytes = aie::load_v<HALF>((const uint8 *)p);
  aie::vector<uint8, HALF> l = aie::bit_and((uint8)15, bytes);
  aie::vector<uint8, HALF> h = aie::logical_downshift(bytes, 4);
  lo = aie::accum<accfloat, HALF>(aie::to_float(l)).template to_vector<bf16>();
  hi = aie::accum<accfloat, HALF>(aie::to_float(h)).template to_vector<bf16>();
}

void gemv_block(const uint8_t *KRESTRICT blk, const bf16 *KRESTRICT x, float *KRESTRICT acc, int col0, int cols) {
  const Block b(blk, cols);
  for (int g = 0; g < cols / GROUP; ++g) {
    const bf16 *xg = x + col0 + g * GROUP;
    aie::vector<bf16, GROUP> xv = aie::load_v<GROUP>(xg);
    float xs = aie::reduce_add(aie::mul(xv, bf16(1.0f)).template to_vector<float>());
    aie::accum<accfloat, HALF> dlo = aie::zeros<accfloat, HALF>();
    aie::accum<accfloat, HALF> dhi = aie::zeros<accfloat, HALF>();
    for (int j = 0; j < GROUP; ++j) {
      aie::vector<bf16, HALF> qlo, qhi;
      column(b.nibbles + (g * GROUP + j) * HALF, qlo, qhi);
      dlo = aie::mac(dlo, qlo, xg[j]);
      dhi = aie::mac(dhi, qhi, xg[j]);
    }
    aie::vector<float, HALF> vlo = dlo.template to_vector<float>();
    aie::vector<float, HALF> vhi = dhi.template to_vector<float>();
    const uint8_t *sc = b.scales + g * ROWS * 2, *mn = b.mins + g * ROWS * 2;
    for (int r = 0; r < ROWS; ++r) {
      float dot = r < HALF ? vlo.get(r) : vhi.get(r - HALF);
      acc[r] += load_bf16(sc + 2 * r) * dot + load_bf16(mn + 2 * r) * xs;
    }
  }
}

#else

void gemv_block(const uint8_t *KRESTRICT blk, const bf16 *KRESTRICT x, float *KRESTRICT acc, int col0, int cols) {
  const Block b(blk, cols);
  for (int g = 0; g < cols / GROUP; ++g) {
    const bf16 *xg = x + col0 + g * GROUP;
    float xs = 0.0f;
    for (int j = 0; j < GROUP; ++j)
      xs += bf16_to_f32(xg[j]);
    const uint8_t *sc = b.scales + g * ROWS * 2, *mn = b.mins + g * ROWS * 2;
    for (int r = 0; r < ROWS; ++r) {
      float dot = 0.0f;
      for (int j = 0; j < GROUP; ++j)
        dot += float(value(b.nibbles, g * GROUP + j, r)) * bf16_to_f32(xg[j]);
      acc[r] += load_bf16(sc + 2 * r) * dot + load_bf16(mn + 2 * r) * xs;
    }
  }
}

#endif

} // namespace

extern "C" void GEMV_Q4NX_SYMBOL(const uint8_t *KRESTRICT blk, const bf16 *KRESTRICT x, float *KRESTRICT acc,
                                 int32_t col0, int32_t cols) {
  gemv_block(blk, x, acc, col0, cols);
}
