"""Survivors the suite expects today, keyed by (group, operator, site), each with the reason it
gets through. Every entry is a mutant that does change the computation: equivalent mutants are
proved by rule in `operators.py`, not listed here. When the comparison tightens, entries that no
longer survive are reported as stale, so the list only shrinks.
"""
from __future__ import annotations

TOLERANCE = ("the comparison's tolerance: the change is below 2^-6 x (|sim| + row max), "
             "the bound verify-mlir allows for summation order")
MEAN_DIVISOR = ("the comparison's tolerance: RMSNorm divides by dim + 1 instead of dim, a systematic "
                "sqrt(257/256) = +0.2 % on every output, under the 2^-6 per-element bound")
NORM_SWAP = ("the comparison's tolerance and the test inputs: x and the norm weight trade places around "
             "one intermediate bf16 rounding (weights are 1 +- 0.1), about one ulp apart")
DIAGONAL_MASK = ("the test inputs: at the one verified offset (q_start 32 with 32-row tiles) the only masked "
                 "tile has k_pos0 == q_pos0, so swapping them is invisible; other offsets would kill it")

SUMSQ_START = ("the comparison's tolerance: the sum of squares starts at 1 instead of 0, the mean square "
               "+1/dim, so every output about -0.2 %, under the 2^-6 per-element bound")
ITEM_COUNT = ("equivalent at this shape, though no rule proves it: 4 and 5 are both the item count and the "
              "core-index stride; either way items 0-3 (4 heads x 1 query tile) go to cores (0,0)-(0,3) and "
              "no core gets an index of 4")
TILE_COUNT = ("equivalent at this offset, though no rule proves it: ceil-division by 32 with 32 in place of 31 "
              "still gives 2 tiles after the cap at the context's tile count, and the mask guard "
              "k0 + 32 > q_start is true on the same tiles (k0 = 0, 32) as k0 + 31 > q_start")

SURVIVORS: dict[tuple[str, str, str], str] = {
    ("rms_gemms_rope_s32", "swap_generic_inputs", "rmsnorm:generic@52"): NORM_SWAP,
    ("o_ffn_s32", "swap_generic_inputs", "rmsnorm:generic@36"): NORM_SWAP,
    ("rms_gemv_rope", "swap_generic_inputs", "rmsnorm:generic@36"): NORM_SWAP,
    ("o_gemv_ffn", "swap_generic_inputs", "rmsnorm:generic@32"): NORM_SWAP,
    ("rms_gemms_rope_s32", "const_float_plus1", "rmsnorm:const.%rmsnorm_cst@28"): SUMSQ_START,
    ("o_ffn_s32", "const_float_plus1", "rmsnorm:const.%rmsnorm_cst@12"): SUMSQ_START,
    ("rms_gemv_rope", "const_float_plus1", "rmsnorm:const.%rmsnorm_cst@14"): SUMSQ_START,
    ("o_gemv_ffn", "const_float_plus1", "rmsnorm:const.%rmsnorm_cst@10"): SUMSQ_START,
    ("rms_gemms_rope_s32", "const_float_plus1", "rmsnorm:const.%rmsnorm_cst_1@29"): MEAN_DIVISOR,
    ("o_ffn_s32", "const_float_plus1", "rmsnorm:const.%rmsnorm_cst_1@13"): MEAN_DIVISOR,
    ("flash_attn_s32_c64", "const_int_plus1", "flash_attn:const.%flash_attn_c4_1@10"): ITEM_COUNT,
    ("flash_attn_s32_c64", "const_int_plus1", "flash_attn:const.%flash_attn_c31@17"): TILE_COUNT,
    ("rms_gemv_rope", "const_float_plus1", "rmsnorm:const.%rmsnorm_cst_1@15"): MEAN_DIVISOR,
    ("o_gemv_ffn", "const_float_plus1", "rmsnorm:const.%rmsnorm_cst_1@11"): MEAN_DIVISOR,
    ("flash_attn_s32_c64", "call_swap_args", "flash_attn:call.attn_mask_d64_t32.1-2@57"): DIAGONAL_MASK,
}
