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

#if defined(GEMV_TILE_K)

// acc[r] += W[r, 0:TILE_K] · x[col0 : col0 + TILE_K]: one K tile of TILE_M rows, the f32 sums
// kept by the caller across the tiles (Defines: GEMV_TILE_K as well).
#if defined(__AIENGINE__)

template <int TILE_M, int TILE_K>
void gemv_acc(const bf16 *KRESTRICT w, const bf16 *KRESTRICT x, float *KRESTRICT acc) {
  constexpr int N = 32;
  static_assert(TILE_K % N == 0, "TILE_K must be a whole number of 32-lane vectors");
  for (int r = 0; r < TILE_M; ++r) {
    const bf16 *KRESTRICT row = w + r * TILE_K;
    aie::accum<accfloat, N> sum = aie::zeros<accfloat, N>();
    for (int k = 0; k < TILE_K; k += N)
      sum = aie::mac(sum, aie::load_v<N>(row + k), aie::load_v<N>(x + k));
    acc[r] += aie::reduce_add(sum.template to_vector<float>());
  }
}

#else

template <int TILE_M, int TILE_K>
void gemv_acc(const bf16 *KRESTRICT w, const bf16 *KRESTRICT x, float *KRESTRICT acc) {
  for (int r = 0; r < TILE_M; ++r) {
    const bf16 *KRESTRICT row = w + r * TILE_K;
    float sum = 0.0f;
    for (int k = 0; k < TILE_K; ++k)
      sum += bf16_to_f32(row[k]) * bf16_to_f32(x[k]);
    acc[r] += sum;
  }
}

#endif

} // namespace

extern "C" void GEMV_SYMBOL(const bf16 *KRESTRICT w, const bf16 *KRESTRICT x, float *KRESTRICT acc,
                            int32_t col0) {
  gemv_acc<GEMV_TILE_M, GEMV_TILE_K>(w, x + col0, acc);
}

#else

#if defined(__AIENGINE__)

template <int TILE_M, int K>
void gemv(const bf16 *KRESTRICT w, const bf16 *KRESTRICT x, bf16 *KRESTRICT y) {
  constexpr int N = 32;
  static_assert(K % N == 0, "K must be a whole number of 32-lane vectors");
  for (int r = 0; r < TILE_M; ++r) {
    const bf16 *KRESTRICT row = w + r * K;
    aie::accum<accfloat, N> acc = aie::zeros<accfloat, N>();
    for (int k = 0; k < K; k += N)
      acc = aie::mac(acc, aie::load_v<N>(row + k), aie::load_v<N>(x + k));
    y[r] = f32_to_bf16(aie::reduce_add(acc.template to_vector<float>()));
  }
}

#else

template <int TILE_M, int K>
void gemv(const bf16 *KRESTRICT w, const bf16 *KRESTRICT x, bf16 *KRESTRICT y) {
  for (int r = 0; r < TILE_M; ++r) {
    const bf16 *KRESTRICT row = w + r * K;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k)
      acc += bf16_to_f32(row[k]) * bf16_to_f32(x[k]);
    y[r] = f32_to_bf16(acc);
  }
}

#endif

} // namespace

extern "C" void GEMV_SYMBOL(const bf16 *KRESTRICT w, const bf16 *KRESTRICT x,
                            bf16 *KRESTRICT y) {
  gemv<GEMV_TILE_M, GEMV_K>(w, x, y);
}

#endif
