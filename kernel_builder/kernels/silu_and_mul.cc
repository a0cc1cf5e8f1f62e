// The SwiGLU activation over one tile: out = SiLU(gate) * up, SiLU(g) = g * sigmoid(g).
//
// Fused so the gate activation never round-trips through bf16: SiLU and the product are
// evaluated in f32 and rounded to bf16 once.
//
// Defines: SWIGLU_TILE (elements per call), SWIGLU_SYMBOL (the exported name).
#include "bf16.h"

#if !defined(__AIENGINE__)
#include <cmath>
#endif

namespace {

#if defined(__AIENGINE__)

template <int TILE>
void silu_and_mul(const bf16 *KRESTRICT gate, const bf16 *KRESTRICT up, bf16 *KRESTRICT out) {
  constexpr int N = 16;
  static_assert(TILE % N == 0, "the tile must be a whole number of 16-lane vectors");
  const auto saved = aie::swap_rounding(aie::rounding_mode::conv_even);
  const aie::vector<bf16, N> half = aie::broadcast<bf16, N>(0.5f);
  for (int i = 0; i < TILE; i += N) {
    aie::vector<bf16, N> g = aie::load_v<N>(gate + i);
    aie::vector<bf16, N> u = aie::load_v<N>(up + i);
    // sigmoid(g) = (1 + tanh(g / 2)) / 2 needs no division; the aie2p tanh returns bf16,
    // which bounds the activation's error at bf16 level, the output's own resolution.
    aie::accum<accfloat, N> half_g = aie::mul(g, half);
    aie::vector<bf16, N> t = aie::tanh<bf16>(half_g.template to_vector<float>());
    aie::accum<accfloat, N> sig = aie::mul(t, half);
    sig = aie::add(sig, half);
    // g * u is exact in f32, so the product with the sigmoid rounds once.
    aie::accum<accfloat, N> gu = aie::mul(g, u);
    aie::accum<accfloat, N> y =
        aie::mul(gu.template to_vector<float>(), sig.template to_vector<float>());
    aie::store_v(out + i, y.template to_vector<bf16>());
  }
  aie::set_rounding(saved);
}

#else

template <int TILE>
void silu_and_mul(const bf16 *KRESTRICT gate, const bf16 *KRESTRICT up, bf16 *KRESTRICT out) {
  for (int i = 0; i < TILE; ++i) {
    const float g = bf16_to_f32(gate[i]);
    const float silu = g / (1.0f + std::exp(-g));
    out[i] = f32_to_bf16(silu * bf16_to_f32(up[i]));
  }
}

#endif

} // namespace

extern "C" void SWIGLU_SYMBOL(const bf16 *KRESTRICT gate, const bf16 *KRESTRICT up,
                              bf16 *KRESTRICT out) {
  silu_and_mul<SWIGLU_TILE>(gate, up, out);
}
