// y = W x for one L1 tile of output rows: W is [TILE_M, K] row-major (the checkpoint's
// [out, in] layout, so decode reads the same weight buffer as prefill), x is [K].
//
// Each row is one dot product accumulated in f32 and rounded to bf16 once. K is a
// compile-time constant because the MLIR declaration carries it in the memref type; the
// build compiles this file once per (TILE_M, K) under its own symbol, which is what lets
// the K = hidden and K = ffn variants live in one stitched module.
//
// Defines: GEMV_TILE_M, GEMV_K, GEMV_SYMBOL (the exported name).
#include "bf16.h"

namespace {

// One row of W times x over N columns, summed in f32: what both entry points are made of.
#if defined(__AIENGINE__)

template <int N>
float row_dot(const bf16 *KRESTRICT row, const bf16 *KRESTRICT x) {
  constexpr int L = 32;
  static_assert(N % L == 0, "a row must be a whole number of 32-lane vectors");
  aie::accum<accfloat, L> sum = aie::zeros<accfloat, L>();
  for (int k = 0; k < N; k += L)
    sum = aie::mac(sum, aie::load_v<L>(row + k), aie::load_v<L>(x + k));
  return aie::reduce_add(sum.template to_vector<float>());
}

#else

template <int N>
float row_dot(const bf16 *KRESTRICT row, const bf16 *KRESTRICT x) {
  float sum = 0.0f;
  for (int k = 0; k < N; ++k)
    sum += bf16_to_f32(row[k]) * bf16_to_f32(x[k]);
  return sum;
}

#endif

} // namespace

#if defined(GEMV_TILE_K)

// acc[r] += W[r, 0:TILE_K] · x[col0 : col0 + TILE_K]: one K tile of TILE_M rows, the f32 sums
// kept by the caller across the tiles (Defines: GEMV_TILE_K as well).
extern "C" void GEMV_SYMBOL(const bf16 *KRESTRICT w, const bf16 *KRESTRICT x, float *KRESTRICT acc,
                            int32_t col0) {
  for (int r = 0; r < GEMV_TILE_M; ++r)
    acc[r] += row_dot<GEMV_TILE_K>(w + r * GEMV_TILE_K, x + col0);
}

#else

extern "C" void GEMV_SYMBOL(const bf16 *KRESTRICT w, const bf16 *KRESTRICT x,
                            bf16 *KRESTRICT y) {
  for (int r = 0; r < GEMV_TILE_M; ++r)
    y[r] = f32_to_bf16(row_dot<GEMV_K>(w + r * GEMV_K, x));
}

#endif
