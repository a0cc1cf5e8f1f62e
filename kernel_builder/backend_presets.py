"""Per-group backend options: herd shapes, tile sizes, compiler flags and prefill buckets.

These are the knobs a kernel engineer tunes on hardware; keeping them here (and nowhere else)
lets the declarations in `groups.py` stay about *what* is computed. Tile choices are derived
from the problem shape so every supported config (1B, 3B, SmolLM2) gets legal tilings:
a tile divides its dimension and fits the 64 KiB L1 of an AIE2P core with double buffering.
"""
from __future__ import annotations

from kernel_builder import hw_rules
from llama_base import q4nx

# The array and its memories are hardware facts, declared with the other rules in `hw_rules`.
ARRAY_COLS, ARRAY_ROWS = hw_rules.ARRAY_COLS, hw_rules.ARRAY_ROWS
L1_BYTES, L1_BUDGET, L2_BYTES = hw_rules.L1_BYTES, hw_rules.L1_BUDGET, hw_rules.L2_BYTES
GEMM_HERD = (8, 4)
ELEMENTWISE_HERD = (8, 1)
ROPE_HERD_PREFILL = (8, 1)
ROPE_HERD_DECODE = (1, 1)
PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048)
BF16 = 2


def _largest_divisor(n: int, cap: int, multiple: int = 1) -> int:
    """Largest d <= cap with n % d == 0 and d % multiple == 0 (falls back to 1)."""
    for d in range(min(cap, n), 0, -1):
        if n % d == 0 and d % multiple == 0:
            return d
    return 1


def gemm_l1_bytes(tm: int, tn: int, tk: int) -> int:
    """Double-buffered A and W tiles, the f32 accumulator and the bf16 output tile."""
    return 2 * (tm + tn) * tk * BF16 + tm * tn * (4 + BF16)


def gemm_l2_bytes(m_blk: int, n_blk: int, k_l2: int, split_k: bool) -> int:
    """Double-buffered A and W panels, plus the block's f32 partial sums when K takes several steps."""
    return 2 * (m_blk + n_blk) * k_l2 * BF16 + (m_blk * n_blk * 4 if split_k else 0)


def gemm_tiling(m: int, n: int, k: int) -> dict:
    """C[m,n] = A[m,k] · W[n,k]^T on the [8,4] herd: rows of A over herd rows, W rows over columns.

    `tile_k_l2` is the K extent staged in L2 per step. A full-K panel of A and W does not fit a
    memory tile for any real layer, so K is streamed; when it takes more than one step the
    block's f32 partial sums stay in L2 between steps and count against the budget. `tile_m`
    shrinks until both the core tiles fit L1 and the block fits a memory tile.
    """
    hm, hn = GEMM_HERD
    tk = _largest_divisor(k, 64, 16)
    tn = _largest_divisor(max(n // hn, 1), 64, 16 if n // hn >= 16 else 1)
    steps = [s for s in range(k, tk - 1, -tk) if k % s == 0]
    return _search_tile_m(m, n, k, (hm, hn), tn, tk, steps, gemm_l1_bytes, gemm_l2_bytes, "GEMM")


def _search_tile_m(m: int, n: int, k: int, herd: tuple[int, int], tn: int, tk: int, k_steps: list[int],
                   l1_bytes, l2_bytes, what: str) -> dict:
    """The largest `tile_m` (multiples of 8 first) whose core tiles fit L1, with the largest K step
    in `k_steps` whose panels fit a memory tile: the search every GEMM tiling makes."""
    hm, hn = herd
    per_row = max(m // hm, 1)
    tms = sorted((d for d in range(1, min(per_row, 64) + 1) if per_row % d == 0),
                 key=lambda d: (d % 8 == 0, d), reverse=True)
    for tm in tms:
        if l1_bytes(tm, tn, tk) > L1_BUDGET:
            continue
        for k_l2 in k_steps:
            if l2_bytes(hm * tm, hn * tn, k_l2, k_l2 < k) <= L2_BYTES:
                return {"M": m, "N": n, "K": k, "herd": herd, "tile_m": tm, "tile_n": tn,
                        "tile_k": tk, "tile_k_l2": k_l2}
    raise ValueError(f"no {what} tiling of {m}x{n}x{k} fits L1 ({L1_BUDGET} B) and L2 ({L2_BYTES} B)")


def gemv_tiling(m: int, k: int) -> dict:
    """y[m] = W[m,k] · x[k] on [8,1]: each core owns m/8 rows, `tile_m` rows at a time in L1.

    `tile_m` is the largest count of rows that divides a core's share, moves whole 32-bit words
    out (an even number of bf16 rows: the DMAs move words) and fits L1 with its slab of W
    double-buffered. When no full-K slab of even rows fits (the down projection's K = ffn: at
    K = 8192 two rows double-buffered need 80 KiB), K is split into `tile_k` columns, the
    longest whole-word run a shim DMA row can wrap (`hw_rules.SHIM`), each core keeping f32
    sums across the K tiles. `tile_k` = K means no split. The K=ffn GEMV gets its own kernel
    symbol (see `externs.py`) because the extern declaration's memref types carry K.

    The cost model (`npu_runtime.cost.tiling`) ranks every tiling, K splits included, but this
    module is build-time and sits below the runtime, so it cannot ask the model; it keeps this
    rule, and `tests/test_cost_model.py` holds the tiling it gives every GEMV of Llama-3.2-1B,
    3B, SmolLM2 and the tiny models to within the model's margin of its best legal candidate
    (`tiling.MARGIN`, 1 %, or `MARGIN_S`). Within that margin the rule prefers what the model
    does not price: long contiguous runs of W per DMA (the model's best for the down projection
    reads 64-byte runs) and few partial-sum updates per output row.
    """
    herd = (ARRAY_COLS, 1) if m % ARRAY_COLS == 0 else (1, 1)
    per_core = m // herd[0]
    rows = [d for d in range(per_core, 0, -1) if per_core % d == 0 and d * BF16 % hw_rules.WORD == 0]
    for tm in rows:
        if gemv_l1_bytes(tm, k, k) <= L1_BUDGET:
            return {"M": m, "K": k, "herd": herd, "tile_m": tm, "tile_k": k}
    run = hw_rules.SHIM.max_wrap * hw_rules.WORD // BF16
    tk = _largest_divisor(k, run, hw_rules.WORD // BF16)
    for tm in rows:
        if gemv_l1_bytes(tm, k, tk) <= L1_BUDGET:
            return {"M": m, "K": k, "herd": herd, "tile_m": tm, "tile_k": tk}
    raise ValueError(f"no GEMV tiling of {m}x{k} moves whole words and fits L1 ({L1_BUDGET} B)")


def gemv_l1_bytes(tile_m: int, k: int, tile_k: int) -> int:
    """x, a double-buffered tile_m x tile_k slab of W and the output tile (doubled: it drains
    while the next fills), plus the f32 sums when K is split."""
    return (k + 2 * tile_m * tile_k + 2 * tile_m) * BF16 + (tile_m * 4 if tile_k < k else 0)


def gemv_q4nx_tiling(m: int, k: int) -> dict:
    """y[m] = W[m,k] · x[k] with W in Q4NX, dequantized inside the product (FusedDQP).

    Each core owns whole row-blocks (`q4nx.ROWS` rows), so its share of W is one contiguous
    run; the herd is the most cores up to a column of the array that split the row-blocks
    evenly. A core streams its rows one Q4NX block at a time (`tile_k` columns: 5 KiB),
    double-buffered, whatever K is, so no K is too long for L1.
    """
    cores = _largest_divisor(m // q4nx.ROWS, ARRAY_COLS)
    return {"M": m, "K": k, "herd": (cores, 1), "tile_m": q4nx.ROWS, "tile_k": min(q4nx.COLS, k)}


def gemv_q4nx_rows(rows: int) -> int:
    """The rows a Q4NX GEMV of at least `rows` outputs is declared with (the LM head's vocabulary
    partitions, which are padded anyway): whole row-blocks and, past one per core of a column,
    a multiple of that, so `gemv_q4nx_tiling` splits them over every core. Llama-3.2-1B's
    16 032-row partitions are 501 row-blocks, which only 3 cores share evenly; 504 keep 8 busy
    for 0.6 % more bytes."""
    blocks = -(-rows // q4nx.ROWS)
    if blocks > ARRAY_COLS:
        blocks = -(-blocks // ARRAY_COLS) * ARRAY_COLS
    return blocks * q4nx.ROWS


def gemv_q4nx_l1_bytes(tile_k: int, k: int) -> int:
    """x, a double-buffered Q4NX block of `tile_k` columns, the f32 accumulator and the bf16
    output of one row-block."""
    return k * BF16 + 2 * q4nx.BYTES_PER_COL * tile_k + q4nx.ROWS * (4 + BF16)


def gemm_q4nx_l1_bytes(tm: int, tn: int, tk: int) -> int:
    """Double-buffered A tiles and Q4NX W tiles, the W tile dequantized to bf16, the f32
    accumulator and the bf16 output tile."""
    return 2 * tm * tk * BF16 + 2 * q4nx.nbytes(tn, tk) + tn * tk * BF16 + tm * tn * (4 + BF16)


def gemm_q4nx_l2_bytes(m_blk: int, n_blk: int, k_l2: int, split_k: bool) -> int:
    """Double-buffered A panels and Q4NX W panels, plus the f32 partial sums when K takes
    several steps."""
    return 2 * (m_blk * k_l2 * BF16 + q4nx.nbytes(n_blk, k_l2)) + (m_blk * n_blk * 4 if split_k else 0)


def q4nx_k_steps(k: int, tk: int) -> list[int]:
    """The L2 steps a Q4NX W panel may take along K: all of K, or whole blocks, so a panel row-block
    is one contiguous run of the matrix's bytes; and `tk` must divide each of its blocks so a
    core's tile never straddles two (whose scales sit apart)."""
    steps = [s for s in range(k, 0, -q4nx.GROUP) if k % s == 0 and (s == k or s % q4nx.COLS == 0)]
    return [s for s in steps if all(c % tk == 0 for _, c in q4nx.Layout(q4nx.ROWS, s).col_blocks())]


def q4nx_gemm_herds(n: int) -> list[tuple[int, int, int, tuple[int, int]]]:
    """The two ways a Q4NX GEMM with `n` rows of W may sit on the GEMM herd, as (`m_axis`, herd
    size along M, herd size along N, the herd as the array sees it): rows of A along the array's
    columns (`m_axis` 0) or its rows (1), with as many cores along N as split W's row-blocks
    evenly."""
    out = []
    for m_axis in (0, 1):
        along_m, along_n = GEMM_HERD if m_axis == 0 else GEMM_HERD[::-1]
        hn = _largest_divisor(n // q4nx.ROWS, along_n)
        out.append((m_axis, along_m, hn, (along_m, hn) if m_axis == 0 else (hn, along_m)))
    return out


def q4nx_tile_ns(n: int, hn: int) -> list[int]:
    """Every `tile_n` of whole row-blocks that divides a core's share of W's `n` rows over `hn`
    cores along N, widest first."""
    per_core = n // q4nx.ROWS // hn
    return [q4nx.ROWS * d for d in range(per_core, 0, -1) if per_core % d == 0]


def gemm_q4nx_tiling(m: int, n: int, k: int) -> dict:
    """C[m,n] = A[m,k] · W[n,k]^T with W in Q4NX: each core dequantizes its W tile to bf16 in L1
    and runs the bf16 product on it.

    As `gemm_tiling`, with a W tile of whole row-blocks (`q4nx.ROWS` rows) and whole groups
    (`q4nx.GROUP` columns), so it is a contiguous part of each row-block's blocks, and K steps
    of whole blocks (`q4nx_k_steps`). A core expands one weight per `tile_m` multiply-adds, and
    that expansion, not the DMAs (which move 5/16 of bf16's bytes), is what the cost model finds
    bounding these GEMMs; so `tile_m` comes first. Rows of A may walk either dimension of the
    herd (`m_axis`): along the array's 8 columns, as the bf16 GEMM, or along its 4 rows, where
    twice as many rows fit each core for the same L2 (32 against 16 at 2048 prompt rows on
    Llama-3.2-1B). The choice: the most cores, then the largest `tile_m` (multiples of 8
    first), then the fewest bytes read from L3 (A once per block of columns, W once per block
    of rows), then the longest K step (docs/profile.md, "Q4NX on the NPU", prices it).
    """
    tk = _largest_divisor(k, 64, q4nx.GROUP)
    steps = q4nx_k_steps(k, tk)
    found = []
    for m_axis, along_m, hn, herd in q4nx_gemm_herds(n):
        for tn in q4nx_tile_ns(n, hn):
            try:
                t = _search_tile_m(m, n, k, (along_m, hn), tn, tk, steps, gemm_q4nx_l1_bytes, gemm_q4nx_l2_bytes,
                                   "Q4NX GEMM")
            except ValueError:
                continue
            tm, mb, nb = t["tile_m"], along_m * t["tile_m"], hn * tn
            # A is read once per block of columns, W once per block of rows
            l3 = m * k * BF16 * (n // nb) + q4nx.nbytes(n, k) * (m // mb)
            found.append(((along_m * hn, tm % 8 == 0, tm, -l3, t["tile_k_l2"], -m_axis),
                          {**t, "herd": herd, "m_axis": m_axis}))
    if not found:
        raise ValueError(f"no Q4NX GEMM tiling of {m}x{n}x{k} fits L1 ({L1_BUDGET} B) and L2 ({L2_BYTES} B)")
    return max(found, key=lambda f: f[0])[1]


def elementwise_tiling(rows: int, dim: int) -> dict:
    """RMSNorm / add / SwiGLU: whole rows per core when rows split evenly over the herd, else one core.

    RMSNorm reduces over a row, so a row never straddles cores; add and SwiGLU use the same
    split so one rule serves all three.
    """
    herd = ELEMENTWISE_HERD if rows % ELEMENTWISE_HERD[0] == 0 else (1, 1)
    tile = _largest_divisor(dim, 1024, 16 if dim % 16 == 0 else 1)
    return {"herd": herd, "tile": tile}


def attention_l1_bytes(tile: int, head_dim: int) -> int:
    """L1 held by one flash-attention core: q, double-buffered k and v, scores (f32), probabilities,
    the f32 accumulator, the output tile and three per-row f32 vectors (max, sum, rescale)."""
    t, d = tile, head_dim
    return (t * d * BF16 * (1 + 2 + 2 + 1) + t * t * 4 + t * t * BF16 + t * d * 4 + 3 * t * 4)


def attention_tiling(seq: int, head_dim: int) -> dict:
    """Query and key/value tiles of the flash-attention kernel (rows of one head).

    One tile size serves both (the causal mask then only touches the diagonal tile); it is
    the largest that divides the sequence and fits the L1 budget.
    """
    t = 1
    for cand in range(min(seq, 64), 0, -1):
        if seq % cand == 0 and (cand % 16 == 0 or cand == seq) and \
                attention_l1_bytes(cand, head_dim) <= L1_BUDGET:
            t = cand
            break
    return {"tile_q": t, "tile_kv": t, "herd": (ARRAY_COLS, ARRAY_ROWS)}


def group_options(kind: str) -> dict:
    """aircc options per group (attention is compiled alone: stitched, its compile time explodes).

    `omit_while_true_loop` stays off for every group: with it aircc drops the loop that keeps
    each core running, so a core serves one iteration of its launch and stops, and every
    launch with a grid (the prefill GEMMs) would compute only its first block. Upstream's
    GEMM and LLM presets keep it off too. The flag stays an option so that a single-iteration
    group can be tuned on hardware; `tests/test_mlir_groups.py` refuses it on a gridded launch.
    """
    return {"device": "npu2", "output_format": "elf", "omit_while_true_loop": False}


# Positions a decode-attention core streams per chunk, by head size: double-buffered K and V
# chunks [chunk, head_dim] bf16 fit L1 with the query rows, scores and accumulators.
DECODE_CHUNK = {64: 64, 128: 32}


def decode_attention_l1_bytes(group: int, chunk: int, head_dim: int) -> int:
    """L1 of one decode-attention core: its query rows, double-buffered K and V chunks, the f32
    scores, bf16 probabilities, f32 accumulator and the three per-row f32 vectors, and the
    position scalar."""
    g, c, d = group, chunk, head_dim
    return g * d * BF16 + 2 * 2 * c * d * BF16 + g * c * (4 + BF16) + g * d * 4 + 3 * g * 4 + 4


def decode_attention_tiling(q_heads: int, kv_heads: int, head_dim: int, capacity: int) -> dict:
    """Chunk size and cores of single-token attention over the resident cache.

    Each KV head gets `splits` cores (as many as the array holds beside the heads, at most
    its rows), and chunk c of the live positions goes to split c % splits: every split's work
    is within one chunk of the others at any length, and a short context leaves the later
    splits idle rather than unbalanced."""
    chunk = DECODE_CHUNK.get(head_dim, 32)
    group = q_heads // kv_heads
    if capacity % chunk:
        raise ValueError(f"a resident cache of {capacity} positions is not whole {chunk}-position chunks")
    if decode_attention_l1_bytes(group, chunk, head_dim) > L1_BUDGET:
        raise ValueError(f"decode attention of {group} query rows over {chunk}x{head_dim} chunks does not fit L1")
    cols = min(kv_heads, ARRAY_COLS)
    if kv_heads % cols:
        raise ValueError(f"{kv_heads} KV heads do not spread evenly over {cols} columns")
    splits = ARRAY_ROWS * cols // kv_heads
    return {"chunk": chunk, "splits": splits, "herd": (cols, ARRAY_ROWS)}


def attention_merge_herd(kv_heads: int) -> tuple[int, int]:
    """One core per KV head (up to a row of the array) merges that head's splits."""
    return (min(kv_heads, ARRAY_COLS), 1)


def resident_cache_multiple(head_dim: int) -> int:
    """What a resident cache's capacity is a multiple of: whole decode chunks and whole
    prefill attention tiles (64 positions at most)."""
    return max(DECODE_CHUNK.get(head_dim, 32), 64)
