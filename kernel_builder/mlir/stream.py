"""Two-input elementwise kernels (residual add, SwiGLU) as a flat stream of L1 chunks.

Params: `n` (elements), `herd`, `tile` (elements per chunk). Each core owns a contiguous
n / cores slice and walks it `tile` elements at a time: two chunks in, one out. The slots may
be [rows, features] or [features]; `flat_pattern` maps the flat offset back to the slot's
layout, which is the 2-D→1-D variant the o_ffn and o_gemv_ffn groups share.
"""
from __future__ import annotations

from typing import Callable, Sequence

from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import core_index, flat_pattern, kernel, module, single_herd
from kernel_builder.mlir.emit import L1, Emitter, Value

Compute = Callable[[Emitter, Value, Value, Value], None]  # (a, b, out) L1 chunks


def build_stream(launch: Launch, slots: Sequence[Slot], compute: Compute) -> str:
    k = kernel(launch, slots, 2, 1)
    n, tile = k.p("n"), k.p("tile")
    hx, hy = k.herd()
    cores = hx * hy
    shape = k.slots[0].shape
    k.require(all(s.shape == shape and s.dtype == "bf16" for s in k.slots), "slots differ in shape or dtype")
    k.require(k.slots[0].numel == n, f"n={n} but the slots hold {k.slots[0].numel} elements")
    k.require(n % (cores * tile) == 0, f"n={n} does not split into {cores} cores x tile {tile}")
    k.require(shape[-1] % tile == 0, f"tile {tile} would cross a row of {shape[-1]}")
    per_core = n // cores
    with module(k) as (b, args), single_herd(b, k, args) as h:
        a, bb, out = h.args
        base = b.mul(core_index(b, h, (hx, hy)), per_core)
        a1 = b.alloc([tile], "bf16", L1, "a_l1")
        b1 = b.alloc([tile], "bf16", L1, "b_l1")
        o1 = b.alloc([tile], "bf16", L1, "o_l1")
        with b.loop(0, per_core, tile, "e") as e:
            start = b.add(base, e)
            b.dma(a1, None, a, flat_pattern(b, shape, start, tile))
            b.dma(b1, None, bb, flat_pattern(b, shape, start, tile))
            compute(b, a1, b1, o1)
            b.dma(out, flat_pattern(b, shape, start, tile), o1, None)
        b.dealloc(a1, b1, o1)
    return b.text()
