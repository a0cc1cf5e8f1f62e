"""RMSNorm: y = bf16(x · rsqrt(mean(x²) + eps)) · w, rows distributed over the herd.

Params: `rows`, `dim`, `eps`, `herd`. The normalised value is rounded to bf16 before the
weight multiply, which is what the reference (HF `LlamaRMSNorm`) does. A row is reduced on
one core, so each core keeps a whole row, the weight and the output row in L1; rows are
contiguous per core (core c owns rows c·rows/cores ...).
"""
from __future__ import annotations

from typing import Sequence

from kernel_builder.backend_presets import BF16, L1_BUDGET
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import core_index, kernel, module, row_pattern, single_herd
from kernel_builder.mlir.emit import L1, Value

IDENTITY_1D = "affine_map<(d0) -> (d0)>"
TO_SCALAR_1D = "affine_map<(d0) -> (0)>"


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    k = kernel(launch, slots, 2, 1)
    rows, dim, eps = k.p("rows"), k.p("dim"), k.p("eps")
    hx, hy = k.herd()
    cores = hx * hy
    x_s, w_s, y_s = k.slots
    k.require(x_s.shape == y_s.shape and x_s.shape[-1] == dim and w_s.shape == (dim,),
              f"shapes {x_s.shape}, {w_s.shape} -> {y_s.shape} do not match dim {dim}")
    k.require(x_s.numel == rows * dim, f"rows={rows} but x holds {x_s.numel // dim} rows")
    k.require(rows % cores == 0, f"{rows} rows do not split over {cores} cores")
    k.require(3 * dim * BF16 + 4 <= L1_BUDGET, f"a row of {dim} does not fit L1 three times")
    per_core = rows // cores
    with module(k) as (b, args), single_herd(b, k, args) as h:
        x, w, y = h.args
        first_row = b.mul(core_index(b, h, (hx, hy)), per_core)
        w1 = b.alloc([dim], "bf16", L1, "w_l1")
        x1 = b.alloc([dim], "bf16", L1, "x_l1")
        y1 = b.alloc([dim], "bf16", L1, "y_l1")
        ss = b.alloc([1], "f32", L1, "sumsq")
        b.dma(w1, None, w, None)
        with b.loop(0, per_core, 1, "r") as r:
            row = b.add(first_row, r)
            b.dma(x1, None, x, row_pattern(x_s.shape, row, 0, dim))
            b.fill(b.const(0.0, "f32"), ss)

            def square_sum(a: list[Value]) -> list[Value]:
                e = b.extf(a[0])
                return [b.arith("addf", a[1], b.arith("mulf", e, e), hint="acc")]

            b.generic([IDENTITY_1D, TO_SCALAR_1D], ["reduction"], [x1], [ss], square_sum)
            total = b.load(ss, [0], "total")
            mean = b.arith("divf", total, b.const(float(dim), "f32"), hint="mean")
            inv = b.rsqrt(b.arith("addf", mean, b.const(float(eps), "f32"), hint="var"))

            def scale(a: list[Value]) -> list[Value]:
                normed = b.truncf(b.arith("mulf", b.extf(a[0]), inv, hint="n"))
                return [b.truncf(b.arith("mulf", b.extf(normed), b.extf(a[1]), hint="yw"))]

            b.generic([IDENTITY_1D] * 3, ["parallel"], [x1, w1], [y1], scale)
            b.dma(y, row_pattern(y_s.shape, row, 0, dim), y1, None)
        b.dealloc(w1, x1, y1, ss)
    return b.text()
