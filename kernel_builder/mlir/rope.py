"""Half-split RoPE over every head of every row, through the external `rope` kernel.

Params: `rows`, `heads`, `head_dim`, `herd` ([8,1] for prefill rows, [1,1] for the single
decode row). Inputs: activations [rows, heads·head_dim] (or [heads·head_dim]) and the
per-position table [rows, head_dim] (cos | sin halves, see `generate_rope_lut`). Each core
owns consecutive rows; per row it loads the table row once and rotates the heads one by one,
so the kernel always sees contiguous [head_dim] vectors.
"""
from __future__ import annotations

from typing import Sequence

from kernel_builder import externs
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import core_index, kernel, module, row_pattern, single_herd
from kernel_builder.mlir.emit import L1


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    k = kernel(launch, slots, 2, 1)
    rows, heads, d = k.p("rows"), k.p("heads"), k.p("head_dim")
    hx, hy = k.herd()
    cores = hx * hy
    x_s, lut_s, y_s = k.slots
    width = heads * d
    k.require(x_s.shape == y_s.shape and x_s.shape[-1] == width and x_s.numel == rows * width,
              f"activations {x_s.shape} -> {y_s.shape} are not {rows} rows of {heads}x{d}")
    k.require(lut_s.shape[-1] == d and lut_s.numel == rows * d, f"table {lut_s.shape} is not {rows} rows of {d}")
    k.require(d % 2 == 0, f"head_dim {d} has no halves")
    k.require(rows % cores == 0, f"{rows} rows do not split over {cores} cores")
    per_core = rows // cores
    kern = externs.rope(d)
    with module(k) as (b, args), single_herd(b, k, args) as h:
        x, lut, y = h.args
        first = b.mul(core_index(b, h, (hx, hy)), per_core)
        x1 = b.alloc([d], "bf16", L1, "x_l1")
        t1 = b.alloc([d], "bf16", L1, "lut_l1")
        y1 = b.alloc([d], "bf16", L1, "y_l1")
        with b.loop(0, per_core, 1, "r") as r:
            row = b.add(first, r)
            b.dma(t1, None, lut, row_pattern(lut_s.shape, row, 0, d))
            with b.loop(0, width, d, "col") as col:
                b.dma(x1, None, x, row_pattern(x_s.shape, row, col, d))
                b.call(kern, x1, t1, y1)
                b.dma(y, row_pattern(y_s.shape, row, col, d), y1, None)
        b.dealloc(x1, t1, y1)
    return b.text()
