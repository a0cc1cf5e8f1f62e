"""Per-group backend options: herd shapes, tile sizes, compiler flags and prefill buckets.

These are the knobs a kernel engineer tunes on hardware; keeping them here (and nowhere else)
lets the declarations in `groups.py` stay about *what* is computed. Tile choices are derived
from the problem shape so every supported config (1B, 3B, SmolLM2) gets legal tilings:
a tile divides its dimension and fits the 64 KiB L1 of an AIE2P core with double buffering.
"""
from __future__ import annotations

# NPU2 (Strix, AIE2P): 8 columns x 4 compute rows; 64 KiB data memory per core.
ARRAY_COLS, ARRAY_ROWS = 8, 4
L1_BYTES = 64 * 1024
GEMM_HERD = (8, 4)
ELEMENTWISE_HERD = (8, 1)
ROPE_HERD_PREFILL = (8, 1)
ROPE_HERD_DECODE = (1, 1)
PREFILL_BUCKETS = (128, 256, 512, 1024, 2048)
BF16 = 2


def _largest_divisor(n: int, cap: int, multiple: int = 1) -> int:
    """Largest d <= cap with n % d == 0 and d % multiple == 0 (falls back to 1)."""
    for d in range(min(cap, n), 0, -1):
        if n % d == 0 and d % multiple == 0:
            return d
    return 1


def gemm_tiling(m: int, n: int, k: int) -> dict:
    """C[m,n] = A[m,k] · W[n,k]^T on the [8,4] herd: rows of A over herd rows, W rows over columns."""
    hm, hn = GEMM_HERD
    tm = _largest_divisor(max(m // hm, 1), 64, 8 if m // hm >= 8 else 1)
    tn = _largest_divisor(max(n // hn, 1), 64, 16 if n // hn >= 16 else 1)
    tk = _largest_divisor(k, 64, 16)
    return {"M": m, "N": n, "K": k, "herd": GEMM_HERD, "tile_m": tm, "tile_n": tn, "tile_k": tk}


def gemv_tiling(m: int, k: int) -> dict:
    """y[m] = W[m,k] · x[k] on [8,1]: each core owns m/8 rows, `tile_m` rows at a time in L1.

    The K=ffn (down projection) GEMV gets its own kernel symbol (see `externs.py`) because the
    extern declaration's memref types carry K.
    """
    herd = (ARRAY_COLS, 1) if m % ARRAY_COLS == 0 else (1, 1)
    per_core = m // herd[0]
    budget = L1_BYTES // 4  # double-buffered W tile plus x, y and headroom
    tm = _largest_divisor(per_core, max(budget // (k * BF16), 1))
    return {"M": m, "K": k, "herd": herd, "tile_m": tm}


def elementwise_tiling(rows: int, dim: int) -> dict:
    """RMSNorm / add / SwiGLU: whole rows per core when rows split evenly over the herd, else one core.

    RMSNorm reduces over a row, so a row never straddles cores; add and SwiGLU use the same
    split so one rule serves all three.
    """
    herd = ELEMENTWISE_HERD if rows % ELEMENTWISE_HERD[0] == 0 else (1, 1)
    tile = _largest_divisor(dim, 1024, 16 if dim % 16 == 0 else 1)
    return {"herd": herd, "tile": tile}


def attention_tiling(seq: int, head_dim: int) -> dict:
    """Query and key/value tiles of the flash-attention kernel (rows of one head)."""
    t = _largest_divisor(seq, 64, 16)
    return {"tile_q": t, "tile_kv": t, "herd": (ARRAY_COLS, ARRAY_ROWS)}


def group_options(kind: str) -> dict:
    """aircc options per group. Attention is compiled alone: stitched, its compile time explodes."""
    opts = {"device": "npu2", "output_format": "elf", "omit_while_true_loop": True}
    if kind == "flash_attn":
        opts["omit_while_true_loop"] = False
    return opts
