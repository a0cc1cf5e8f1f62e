"""NPU2 (Strix, AIE2P / AIE-ML v2) rates the cost model charges, each with where it comes from.

The array's shape and memory sizes live in `kernel_builder.backend_presets` (the builders
tile against them); this module holds only the rates, which nothing but the cost model reads.
Where a rate is not published, it is derived from one that is, and the derivation is stated;
the three constants that no public source gives (`Calibration`) are fitted in `calibrate.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernel_builder.backend_presets import ARRAY_COLS, ARRAY_ROWS

# AMD rates the Ryzen AI 300 (Strix, XDNA2) NPU at 50 TOPS int8. An AIE-ML v2 core does an
# 8x8x8 int8 matrix product (512 MACs, 1024 operations) per cycle (D. Estevez, "Getting peak
# TOPS on a Ryzen AI 7 350 NPU", destevez.net, 2026-05), so 50e12 / (32 cores x 1024) gives
# the clock.
PUBLISHED_INT8_OPS = 50e12
INT8_MACS_PER_CYCLE = 512
CLOCK_HZ = PUBLISHED_INT8_OPS / (ARRAY_COLS * ARRAY_ROWS * 2 * INT8_MACS_PER_CYCLE)   # ~1.53 GHz

# bf16 at half the int8 MAC rate: the ratio AM020 (AIE-ML architecture manual, "Summary" table:
# 512 int8 and 256 bfloat16 operations per tile per cycle) gives for the previous generation;
# UG1603 says AIE-ML v2 widens the SIMD without giving its bf16 figure.
BF16_MACS_PER_CYCLE = INT8_MACS_PER_CYCLE // 2

# Elementwise work (norms, adds, SwiGLU, RoPE, softmax) runs on f32 in the vector unit's
# accumulator lanes: 16 lanes of 32 bits in a 512-bit register is the model's assumption.
VECTOR_LANES = 16

# DMA channels. AM027 (AIE-ML v2 architecture manual, "Memory Tile Features"): a memory tile
# has six MM2S and six S2MM channels with 64-bit stream interfaces; UG1603: the AIE-ML v2 stream
# switch is 64 bits wide. A shim (array interface) tile has two MM2S and two S2MM channels per
# column, and a compute tile's DMA two of each, as on AIE-ML (AM020).
CHANNEL_BYTES_PER_CYCLE = 8
SHIM_CHANNELS_PER_COLUMN = 2        # per direction
MEMTILE_CHANNELS = 6                # per direction, one memory tile per column
CORE_CHANNELS = 2                   # per direction, per compute tile

# Fixed work of one DMA transfer (a buffer descriptor: lock acquire, address generation start,
# lock release) in cycles. Not published; an assumption of the model, which only ranks tilings
# that move the same bytes in more or fewer transfers by it.
DMA_TRANSFER_CYCLES = 64


@dataclass(frozen=True)
class Calibration:
    """The constants no public document gives, fitted to upstream's measured NPU2 figures."""

    gemm_efficiency: float     # fraction of the bf16 peak the cores reach in contractions
    l3_bandwidth: float        # bytes/s the NPU's DMAs get from DDR, all shim channels together
    call_overhead_s: float     # per group call: XRT dispatch, BO syncs and the host work between calls
    # Fraction of the bf16 peak a decode-attention core reaches (one token's few query rows of a
    # KV head against its cached positions); None: the contractions' `gemm_efficiency`.
    decode_attention_efficiency: float | None = None

    @property
    def attention_efficiency(self) -> float:
        return self.gemm_efficiency if self.decode_attention_efficiency is None else self.decode_attention_efficiency


# The fit of `calibrate.fit()`, kept here so an estimate needs no fit (the fit walks three
# models' modules); `tests/test_cost_model.py` re-fits and fails if these drift from it.
FITTED = Calibration(gemm_efficiency=0.20, l3_bandwidth=38.9e9, call_overhead_s=0.575e-3)

# The fused decode's calibration (`fused_fit.fit()`): FITTED's GEMM efficiency and call overhead,
# the DDR bandwidth and the decode-attention efficiency fitted to upstream's fused decode on a
# Krackan laptop (2x DDR5-5600); the same drift test holds these to the fit.
FITTED_FUSED = Calibration(gemm_efficiency=0.20, l3_bandwidth=63.5e9, call_overhead_s=0.575e-3,
                           decode_attention_efficiency=0.0172)

__all__ = ["FITTED", "FITTED_FUSED", "BF16_MACS_PER_CYCLE", "CHANNEL_BYTES_PER_CYCLE", "CLOCK_HZ", "CORE_CHANNELS", "Calibration",
           "DMA_TRANSFER_CYCLES", "MEMTILE_CHANNELS", "SHIM_CHANNELS_PER_COLUMN", "VECTOR_LANES"]
