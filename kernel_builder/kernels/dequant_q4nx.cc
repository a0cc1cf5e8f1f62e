// Prefill's dequantization: a Q4NX tile (itself a Q4NX matrix [ROWS_T, COLS_T], layout in
// q4nx.h) to the bf16 tile [ROWS_T, COLS_T] row-major that the GEMM's product reads.
//
// Numerics, both paths, bit-exact with llama_base.q4nx.dequantize: w = q * scale + min with the
// product exact in f32 (a 4-bit integer times a bf16) and the sum rounded once to f32, then
// rounded to bf16, nearest-even. The AIE path forms q * scale + min in an f32 accumulator from
// the bf16 min and rounds with conv_even; that its accumulator rounds the sum as a scalar f32
// addition does is the hardware's documented float behaviour, not something run here.
//
// Defines: Q4NX_ROWS, Q4NX_COLS, Q4NX_GROUP (the format), DEQUANT_Q4NX_ROWS, DEQUANT_Q4NX_COLS
// (the tile), DEQUANT_Q4NX_SYMBOL (the exported name).
#include "q4nx.h"

namespace {

using namespace q4nx;

constexpr int ROWS_T = DEQUANT_Q4NX_ROWS;
constexpr int COLS_T = DEQUANT_Q4NX_COLS;
static_assert(ROWS_T % ROWS == 0 && COLS_T % GROUP == 0, "a tile is whole row-blocks and groups");

constexpr int block_width(int c0) { return COLS_T - c0 < COLS ? COLS_T - c0 : COLS; }

#if defined(__AIENGINE__)

// One group's ROWS / 2 rows starting at `half` of column j, as w = q * scale + min in bf16.
static inline aie::vector<bf16, HALF> half_column(const Block &b, int j, int half) {
  aie::vector<uint8, HALF> bytes = aie::load_v<HALF>((const uint8 *)(b.nibbles + j * HALF));
  aie::vector<uint8, HALF> q = half ? aie::logical_downshift(bytes, 4) : aie::bit_and((uint8)15, bytes);
  aie::vector<bf16, HALF> qb = aie::accum<accfloat, HALF>(aie::to_float(q)).template to_vector<bf16>();
  const int at = ((j / GROUP) * ROWS + half * HALF) * 2;
  aie::vector<bf16, HALF> s = aie::load_v<HALF>((const bf16 *)(b.scales + at));
  aie::vector<bf16, HALF> m = aie::load_v<HALF>((const bf16 *)(b.mins + at));
  return aie::mac(aie::accum<accfloat, HALF>(m), qb, s).template to_vector<bf16>();
}

void dequant(const uint8_t *KRESTRICT tile, bf16 *KRESTRICT out) {
  const auto saved = aie::swap_rounding(aie::rounding_mode::conv_even);
  for (int rb = 0; rb < ROWS_T / ROWS; ++rb) {
    const uint8_t *row_block = tile + rb * COLS_T * BYTES_PER_COL;
    for (int c0 = 0; c0 < COLS_T; c0 += COLS) {
      const int cols = block_width(c0);
      const Block b(row_block + c0 * BYTES_PER_COL, cols);
      for (int j = 0; j < cols; ++j)
        for (int half = 0; half < 2; ++half) {
          aie::vector<bf16, HALF> w = half_column(b, j, half);
          for (int i = 0; i < HALF; ++i)          // scattered: the tile is row-major
            out[(rb * ROWS + half * HALF + i) * COLS_T + c0 + j] = w.get(i);
        }
    }
  }
  aie::set_rounding(saved);
}

#else

void dequant(const uint8_t *KRESTRICT tile, bf16 *KRESTRICT out) {
  for (int rb = 0; rb < ROWS_T / ROWS; ++rb) {
    const uint8_t *row_block = tile + rb * COLS_T * BYTES_PER_COL;
    for (int c0 = 0; c0 < COLS_T; c0 += COLS) {
      const int cols = block_width(c0);
      const Block b(row_block + c0 * BYTES_PER_COL, cols);
      for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < cols; ++j) {
          const int at = ((j / GROUP) * ROWS + r) * 2;
          float w = float(value(b.nibbles, j, r)) * load_bf16(b.scales + at) + load_bf16(b.mins + at);
          out[(rb * ROWS + r) * COLS_T + c0 + j] = f32_to_bf16(w);
        }
    }
  }
}

#endif

} // namespace

extern "C" void DEQUANT_Q4NX_SYMBOL(const uint8_t *KRESTRICT tile, bf16 *KRESTRICT out) {
  dequant(tile, out);
}
