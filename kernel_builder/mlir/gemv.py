"""Decode projection GEMV, y[M] = W[M,K] · x[K], through the external `gemv` kernel.

Params: `M`, `K`, `herd` ([8,1], or [1,1] when M does not split), `tile_m`, `tile_k`. Each core
owns M / cores consecutive rows; it loads x once and then streams `tile_m`-row slabs of W (full
K, one DMA each) through the kernel. Decode is bandwidth-bound, so the slab is the unit that
keeps the shim DMA busy; the kernel's f32 accumulation makes the result independent of it.
When `tile_k` < K (a K too long for a slab of whole-word output rows to fit L1), each slab is
`tile_k` columns and the kernel adds into f32 sums that stay in L1 across a row tile's K
tiles, rounded to bf16 once (as the full-K kernel rounds).
"""
from __future__ import annotations

from typing import Sequence

from kernel_builder import externs
from kernel_builder.backend_presets import L1_BUDGET, gemv_l1_bytes
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import core_index, kernel, module, round_to_bf16, single_herd
from kernel_builder.mlir.emit import L1


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    k = kernel(launch, slots, 2, 1)
    M, K, tm = k.p("M"), k.p("K"), k.p("tile_m")
    tk = k.launch.param_dict.get("tile_k", K)
    hx, hy = k.herd()
    cores = hx * hy
    x_s, w_s, y_s = k.slots
    k.require((x_s.shape, w_s.shape, y_s.shape) == ((K,), (M, K), (M,)),
              f"slot shapes {x_s.shape}, {w_s.shape} -> {y_s.shape} are not [K], [M,K] -> [M]")
    k.require(M % (cores * tm) == 0, f"M={M} does not split into {cores} cores x tile_m {tm}")
    k.require(K % tk == 0, f"tile_k {tk} does not divide K={K}")
    k.require(gemv_l1_bytes(tm, K, tk) <= L1_BUDGET, f"a {tm}x{tk} slab does not fit L1 twice")
    per_core = M // cores
    kern = externs.gemv(tm, K, tk)
    with module(k) as (b, args), single_herd(b, k, args) as h:
        x, w, y = h.args
        first = b.mul(core_index(b, h, (hx, hy)), per_core)
        x1 = b.alloc([K], "bf16", L1, "x_l1")
        w1 = b.alloc([tm, tk], "bf16", L1, "w_l1")
        acc = b.alloc([tm], "f32", L1, "acc") if tk < K else None
        y1 = b.alloc([tm], "bf16", L1, "y_l1")
        b.dma(x1, None, x, None)
        with b.loop(0, per_core, tm, "m") as m:
            row = b.add(first, m)
            if acc is None:
                b.dma(w1, None, w, ([row, 0], [tm, K], [K, 1]))
                b.call(kern, w1, x1, y1)
            else:
                b.fill(b.const(0.0, "f32"), acc)
                with b.loop(0, K, tk, "kk") as kk:
                    b.dma(w1, None, w, ([row, kk], [tm, tk], [K, 1]))
                    b.call(kern, w1, x1, acc, b.to_i32(kk))
                round_to_bf16(b, acc, y1)
            b.dma(y, ([row], [tm], [1]), y1, None)
        b.dealloc(*(v for v in (x1, w1, acc, y1) if v is not None))
    return b.text()
