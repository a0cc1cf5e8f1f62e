// The Q4NX byte layout as the kernels read it. The format is declared in llama_base/q4nx.py;
// its numbers arrive as -D defines (Q4NX_ROWS, Q4NX_COLS, Q4NX_GROUP, from
// kernel_builder/externs.py), so nothing here restates them.
//
// A block of `cols` columns of one row-block (ROWS rows) is, in this order:
//   4-bit values, column-major: column j is ROWS/2 bytes, byte i holding row i in its low
//     nibble and row i + ROWS/2 in its high nibble;
//   scales, bf16 [cols / GROUP][ROWS];
//   mins,   bf16 [cols / GROUP][ROWS];
// and weight w = q * scale + min.
#pragma once

#include "bf16.h"

namespace q4nx {

constexpr int ROWS = Q4NX_ROWS;
constexpr int COLS = Q4NX_COLS;
constexpr int GROUP = Q4NX_GROUP;
constexpr int HALF = ROWS / 2;                        // bytes of 4-bit values per column
constexpr int BYTES_PER_COL = HALF + 2 * 2 * ROWS / GROUP;

static_assert(ROWS % 2 == 0 && GROUP > 0 && COLS % GROUP == 0, "the Q4NX defines do not describe a layout");

// Where one block's parts start, for a block `cols` wide at `blk`.
struct Block {
  const uint8_t *nibbles;
  const uint8_t *scales;   // bf16 [cols / GROUP][ROWS], as bytes (no alignment assumed on the host)
  const uint8_t *mins;

  Block(const uint8_t *blk, int cols)
      : nibbles(blk), scales(blk + cols * HALF), mins(blk + cols * HALF + cols / GROUP * ROWS * 2) {}
};

// The 4-bit value of row r in column j of a block.
static inline int value(const uint8_t *nibbles, int j, int r) {
  uint8_t b = nibbles[j * HALF + r % HALF];
  return r < HALF ? (b & 15) : (b >> 4);
}

// A bf16 stored at a byte address, widened exactly.
static inline float load_bf16(const uint8_t *p) {
  uint16_t bits;
  __builtin_memcpy(&bits, p, sizeof bits);
  return bf16_to_f32(__builtin_bit_cast(bf16, bits));
}

} // namespace q4nx
