"""A chunk's (or a token's) K and V rows appended to the device-resident, head-major KV cache.

Params: `rows`, `ctx` (the cache's positions), `kv_heads`, `head_dim`. Slots: k and v
[rows, kv_heads·d] (token-major, heads side by side; [kv_heads·d] for one decode row), `start`
[1] i32 (the first row's absolute position), k_cache and v_cache [kv_heads, ctx, d] (`STATE`:
written only at positions start..start + rows - 1, every other position keeps its contents).

A DMA moves data between a tile's memory and the stream switch, so there is no transfer from
one host buffer to another: each core stages its blocks through L1. Work items are (KV head,
block of rows) pairs dealt round-robin to one core per KV head (up to a row of the array);
an item is one strided read of the block's head columns into L1 and one contiguous write of
[block, d] at the block's positions of that head's cache, for K and for V. The position
comes from the `start` scalar at run time, so one module appends at any position.
"""
from __future__ import annotations

from typing import Sequence

from kernel_builder.backend_presets import ARRAY_COLS, BF16
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import core_index, deal_items, kernel, module, row_pattern, single_herd
from kernel_builder.mlir.emit import L1, Index

BLOCK_BYTES = 8 * 1024   # one K (or V) block in L1; with double buffers 32 KiB of a core's L1


def herd(kv_heads: int) -> tuple[int, int]:
    """One core per KV head, up to a row of the array."""
    return (min(kv_heads, ARRAY_COLS), 1)


def block_rows(rows: int, head_dim: int) -> int:
    """Rows of one head an item moves: the most that divide `rows` and fit `BLOCK_BYTES`."""
    most = max(1, BLOCK_BYTES // (head_dim * BF16))
    return max(r for r in range(1, min(rows, most) + 1) if rows % r == 0)


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    k = kernel(launch, slots, 3, 2)
    rows, ctx, kvh, d = k.p("rows"), k.p("ctx"), k.p("kv_heads"), k.p("head_dim")
    k_s, v_s, start_s, kc_s, vc_s = k.slots
    kv = kvh * d
    rows_shape = (kv,) if rows == 1 else (rows, kv)
    k.require(k_s.shape in (rows_shape, (rows, kv)) and v_s.shape == k_s.shape,
              f"k {k_s.shape} / v {v_s.shape} are not {rows} rows of {kvh}x{d}")
    k.require(kc_s.shape == vc_s.shape == (kvh, ctx, d), f"caches {kc_s.shape} are not [{kvh}, {ctx}, {d}]")
    k.require(start_s.shape == (1,) and start_s.dtype == "i32", "start must be an i32 scalar")
    k.require(rows <= ctx, f"{rows} rows do not fit a {ctx}-position cache")
    blk = block_rows(rows, d)
    blocks = rows // blk
    hx, hy = herd(kvh)
    cores = hx * hy
    items = kvh * blocks

    with module(k) as (b, args), single_herd(b, k, args, (hx, hy)) as h:
        k_in, v_in, start, kc, vc = h.args
        core = core_index(b, h, (hx, hy))
        start_l1 = b.alloc([1], "i32", L1, "start_l1")
        b.dma(start_l1, None, start, None)
        at = b.to_index(b.load(start_l1, [0], "start_i32"))
        k1 = b.alloc([blk, d], "bf16", L1, "k_l1")
        v1 = b.alloc([blk, d], "bf16", L1, "v_l1")

        def rows_of(shape, row: Index, head: Index):
            if len(shape) == 1:
                return row_pattern(shape, 0, b.mul(head, d), d)
            return [row, b.mul(head, d)], [blk, d], [kv, 1]

        def item(i: Index) -> None:
            head, row = b.div(i, blocks), b.mul(b.rem(i, blocks), blk)
            pos = b.add(at, row)
            for src, src_s, buf, cache in ((k_in, k_s, k1, kc), (v_in, v_s, v1, vc)):
                b.dma(buf, None, src, rows_of(src_s.shape, row, head))
                b.dma(cache, ([head, pos, 0], [1, blk, d], [ctx * d, d, 1]), buf, None)

        deal_items(b, cores, items, core, item)
        b.dealloc(start_l1, k1, v1)
    return b.text()
