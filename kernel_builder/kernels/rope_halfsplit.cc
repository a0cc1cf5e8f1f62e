// Half-split rotary embedding of one head row at one position (the HF `rotate_half`
// convention): element i turns with element i + h by the angle in LUT column i, h = D / 2.
//
//   y[i]     = x[i]     * cos[i] - x[i + h] * sin[i]
//   y[i + h] = x[i + h] * cos[i] + x[i]     * sin[i]
//
// The LUT row is that position's cos | sin halves, so the kernel reads one contiguous row
// per position whatever the head count. Products of two bf16 are exact in f32, so the only
// roundings are the f32 add and the final round to bf16, in both builds.
//
// Defines: ROPE_HEAD_DIM (D), ROPE_SYMBOL (the exported name).
#include "bf16.h"

namespace {

#if defined(__AIENGINE__)

template <int D>
void rope(const bf16 *KRESTRICT x, const bf16 *KRESTRICT lut, bf16 *KRESTRICT y) {
  constexpr int H = D / 2;
  constexpr int N = 16;
  static_assert(H % N == 0, "each half must be a whole number of 16-lane vectors");
  // The core is shared by every kernel of a stitched group: restore the caller's mode.
  const auto saved = aie::swap_rounding(aie::rounding_mode::conv_even);
  for (int i = 0; i < H; i += N) {
    aie::vector<bf16, N> x1 = aie::load_v<N>(x + i);
    aie::vector<bf16, N> x2 = aie::load_v<N>(x + i + H);
    aie::vector<bf16, N> c = aie::load_v<N>(lut + i);
    aie::vector<bf16, N> s = aie::load_v<N>(lut + i + H);
    aie::accum<accfloat, N> lo = aie::mul(x1, c);
    lo = aie::msc(lo, x2, s);
    aie::accum<accfloat, N> hi = aie::mul(x2, c);
    hi = aie::mac(hi, x1, s);
    aie::store_v(y + i, lo.template to_vector<bf16>());
    aie::store_v(y + i + H, hi.template to_vector<bf16>());
  }
  aie::set_rounding(saved);
}

#else

template <int D>
void rope(const bf16 *KRESTRICT x, const bf16 *KRESTRICT lut, bf16 *KRESTRICT y) {
  constexpr int H = D / 2;
  for (int i = 0; i < H; ++i) {
    const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + H]);
    const float c = bf16_to_f32(lut[i]), s = bf16_to_f32(lut[i + H]);
    y[i] = f32_to_bf16(x1 * c - x2 * s);
    y[i + H] = f32_to_bf16(x2 * c + x1 * s);
  }
}

#endif

} // namespace

extern "C" void ROPE_SYMBOL(const bf16 *KRESTRICT x, const bf16 *KRESTRICT lut,
                            bf16 *KRESTRICT y) {
  rope<ROPE_HEAD_DIM>(x, lut, y);
}
