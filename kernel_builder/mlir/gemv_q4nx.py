"""Decode GEMV on Q4NX weights, y[M] = W[M,K] · x[K], dequantized inside the product (FusedDQP).

Params: `M`, `K`, `herd` (cores, 1), `tile_m` (= `q4nx.ROWS`), `tile_k` (columns of the largest
block, `min(q4nx.COLS, K)`).

Decode reads every weight once per token, so it is bound by the bytes it moves: Q4NX moves 5
bits a weight instead of 16, and the weights are never expanded in memory. Each core owns
whole row-blocks, a contiguous run of W's bytes. It loads x into L1 once, then streams each
row-block one Q4NX block at a time (L3→L1; the compiler's ping-pong doubles the buffer, which
the preset counts) through the external kernel, which unpacks the nibbles and multiplies in one
pass and adds into an f32 accumulator that lives across the blocks of the row-block. The
accumulator, rounded to bf16, leaves as one 64-byte DMA per row-block.

A row's last block is narrower when K is not a multiple of `q4nx.COLS`; it gets its own DMA and
call after the loop over full blocks, so every DMA has static sizes. Every DMA is whole 32-bit
words at word-aligned byte offsets (the AIE DMAs move words): a block is `BYTES_PER_COL` = 20
bytes per column and columns come in multiples of `q4nx.GROUP`.
"""
from __future__ import annotations

from typing import Sequence

from kernel_builder import externs
from kernel_builder.backend_presets import L1_BUDGET, gemv_q4nx_l1_bytes
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import core_index, kernel, module, round_to_bf16, single_herd
from kernel_builder.mlir.emit import L1
from llama_base import q4nx


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    k = kernel(launch, slots, 2, 1)
    M, K, tm, tk = k.p("M"), k.p("K"), k.p("tile_m"), k.p("tile_k")
    hx, hy = k.herd()
    cores = hx * hy
    x_s, w_s, y_s = k.slots
    k.require((x_s.shape, w_s.shape, y_s.shape) == ((K,), (M, K), (M,)) and w_s.quantized,
              f"slot shapes {x_s.shape}, {w_s.shape} -> {y_s.shape} are not [K], Q4NX [M,K] -> [M]")
    k.require(q4nx.fits(M, K), f"[{M}, {K}] is not a Q4NX shape")
    layout = q4nx.Layout(M, K)
    widths = [c for _, c in layout.col_blocks()]
    k.require(tm == q4nx.ROWS, f"tile_m {tm} is not one Q4NX row-block ({q4nx.ROWS} rows)")
    k.require(tk == widths[0], f"tile_k {tk} is not the width of a full block ({widths[0]})")
    k.require(layout.row_blocks % cores == 0, f"{layout.row_blocks} row-blocks do not split over {cores} cores")
    l1 = gemv_q4nx_l1_bytes(tk, K)
    k.require(l1 <= L1_BUDGET, f"x and a double-buffered block need {l1} B of L1")
    full = sum(1 for c in widths if c == tk)          # blocks of full width come first
    tail = K - full * tk
    per_core = layout.row_blocks // cores
    rb_bytes = layout.row_block_bytes
    kern = externs.gemv_q4nx(tk, K)
    with module(k) as (b, args), single_herd(b, k, args) as h:
        x, w, y = h.args
        first = b.mul(core_index(b, h, (hx, hy)), per_core)
        x1 = b.alloc([K], "bf16", L1, "x_l1")
        blk = b.alloc([q4nx.BYTES_PER_COL * tk], "i8", L1, "w_blk")
        acc = b.alloc([tm], "f32", L1, "acc")
        y1 = b.alloc([tm], "bf16", L1, "y_l1")
        b.dma(x1, None, x, None)
        with b.loop(0, per_core, 1, "rb") as rb:
            row_block = b.add(first, rb)
            base = b.mul(row_block, rb_bytes)
            b.fill(b.const(0.0, "f32"), acc)
            with b.loop(0, full * tk, tk, "c") as c0:
                b.dma(blk, None, w, ([b.add(base, b.mul(c0, q4nx.BYTES_PER_COL))], [q4nx.BYTES_PER_COL * tk], [1]))
                b.call(kern, blk, x1, acc, b.to_i32(c0), b.const(tk, "i32"))
            if tail:
                n = q4nx.BYTES_PER_COL * tail
                b.dma(blk, ([0], [n], [1]), w, ([b.add(base, full * tk * q4nx.BYTES_PER_COL)], [n], [1]))
                b.call(kern, blk, x1, acc, b.const(full * tk, "i32"), b.const(tail, "i32"))
            round_to_bf16(b, acc, y1)
            b.dma(y, ([b.mul(row_block, tm)], [tm], [1]), y1, None)
        b.dealloc(x1, blk, acc, y1)
    return b.text()
