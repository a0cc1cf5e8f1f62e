"""Prefill projection GEMM, C[M,N] = A[M,K] · W[N,K]ᵀ (W kept in the checkpoint's [out, in] layout).

Params: `M`, `N`, `K`, `herd` (columns, rows of the array), `tile_m`, `tile_n`, `tile_k`,
`tile_k_l2`, and optionally `m_axis`: the herd dimension that walks M (0, the default: the
array's columns; 1: its rows, so the wider dimension walks N).

Hierarchy and data movement:
- the launch iterates over output blocks of (hm·tile_m) × (hn·tile_n);
- its segment stages K in steps of `tile_k_l2`: one DMA brings the block's A rows and one
  its W rows from L3 into L2 panels, then the herd runs;
- each herd core (one herd dimension over rows, the other over columns) owns a tile_m × tile_n
  output tile and walks the L2 panels `tile_k` at a time (L2→L1 DMAs), accumulating A·Wᵀ in an
  f32 L1 tile;
- when K takes several L2 steps, the f32 tile is parked in an L2 partial-sum block between
  steps (zeroed on the first, rounded to bf16 and written to C on the last); with one step
  the tile goes straight to C.
The contraction is a `linalg.generic` (bf16 products, f32 sums) the compiler vectorises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kernel_builder.backend_presets import L1_BUDGET, L2_BYTES, gemm_l1_bytes, gemm_l2_bytes
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import Kernel, kernel, module, round_to_bf16
from kernel_builder.mlir.emit import L1, L2, Emitter, Index, Value

A_MAP = "affine_map<(d0, d1, d2) -> (d0, d2)>"
W_MAP = "affine_map<(d0, d1, d2) -> (d1, d2)>"
C_MAP = "affine_map<(d0, d1, d2) -> (d0, d1)>"


def _matmul_acc(b: Emitter, a1: Value, w1: Value, acc: Value) -> None:
    def body(x: list[Value]) -> list[Value]:
        prod = b.arith("mulf", b.extf(x[0]), b.extf(x[1]), hint="prod")
        return [b.arith("addf", x[2], prod, hint="acc")]

    b.generic([A_MAP, W_MAP, C_MAP], ["parallel", "parallel", "reduction"], [a1, w1], [acc], body)


@dataclass(frozen=True)
class Bf16Weights:
    """How a GEMM's W reaches the cores: here bf16 [N, K] rows, staged and tiled as they are.

    A weight format is the one thing the GEMM builders differ in, so the launch grid, the K
    steps, the partial sums and the product are written once (`build_gemm`) and a format
    supplies its panel, its core tiles and its walk over a panel (`gemm_q4nx.Q4nxWeights`).
    """

    K: int
    nb: int
    tn: int
    tk: int
    tk2: int

    def check(self, k: Kernel, w_s: Slot) -> None:
        k.require(not w_s.quantized, f"W slot {w_s.name} is {w_s.dtype}, not bf16")

    def l1_bytes(self, tm: int) -> int:
        return gemm_l1_bytes(tm, self.tn, self.tk)

    def l2_bytes(self, mb: int, split: bool) -> int:
        return gemm_l2_bytes(mb, self.nb, self.tk2, split)

    def panel(self, b: Emitter) -> Value:
        return b.alloc([self.nb, self.tk2], "bf16", L2, "w_l2")

    def stage(self, b: Emitter, w2: Value, w: Value, bn: Index, col0: Index, kc: Index) -> None:
        b.dma(w2, None, w, ([col0, kc], [self.nb, self.tk2], [self.K, 1]))

    def tiles(self, b: Emitter) -> list[Value]:
        return [b.alloc([self.tn, self.tk], "bf16", L1, "w_l1")]

    def walk(self, b: Emitter, w2: Value, ty: Index, col: Index, tiles: list[Value],
             load_a: Callable[[Index], None], multiply: Callable[[Value], None]) -> None:
        """Emit the walk over the panel's K: `load_a(kk)` the A tile, then W's, then multiply."""
        (w1,) = tiles
        with b.loop(0, self.tk2, self.tk, "kk") as kk:
            load_a(kk)
            b.dma(w1, None, w2, ([col, kk], [self.tn, self.tk], [self.tk2, 1]))
            multiply(w1)


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    return build_gemm(launch, slots, Bf16Weights)


def build_gemm(launch: Launch, slots: Sequence[Slot], weights: Callable[..., Bf16Weights]) -> str:
    k = kernel(launch, slots, 2, 1)
    M, N, K = k.p("M"), k.p("N"), k.p("K")
    herd = k.herd()
    m_axis = launch.param_dict.get("m_axis", 0)
    k.require(m_axis in (0, 1), f"m_axis {m_axis} is not a herd dimension")
    hm, hn = herd if m_axis == 0 else herd[::-1]
    tm, tn, tk, tk2 = k.p("tile_m"), k.p("tile_n"), k.p("tile_k"), k.p("tile_k_l2")
    a_s, w_s, c_s = k.slots
    k.require((a_s.shape, w_s.shape, c_s.shape) == ((M, K), (N, K), (M, N)),
              f"slot shapes {a_s.shape}, {w_s.shape} -> {c_s.shape} are not [M,K], [N,K] -> [M,N]")
    mb, nb = hm * tm, hn * tn
    k.require(M % mb == 0 and N % nb == 0, f"{M}x{N} is not a whole number of {mb}x{nb} blocks")
    k.require(K % tk2 == 0 and tk2 % tk == 0, f"K={K}, tile_k_l2={tk2}, tile_k={tk} do not nest")
    wf = weights(K, nb, tn, tk, tk2)
    wf.check(k, w_s)
    split = tk2 < K
    l1, l2 = wf.l1_bytes(tm), wf.l2_bytes(mb, split)
    k.require(l1 <= L1_BUDGET and l2 <= L2_BYTES, f"tiles need {l1} B of L1 and {l2} B of L2")

    with module(k) as (b, args):
        hints = [s.name for s in k.slots]
        with b.hierarchy("launch", [M // mb, N // nb], args, hints, id_hints=["bm", "bn"]) as lh:
            bm, bn = lh.ids
            with b.hierarchy("segment", [], [bm, bn, *lh.args], ["bm", "bn", *hints]) as sh:
                s_bm, s_bn, a, w, c = sh.args
                row0, col0 = b.mul(s_bm, mb), b.mul(s_bn, nb)
                a2 = b.alloc([mb, tk2], "bf16", L2, "a_l2")
                w2 = wf.panel(b)
                ops = [a2, w2, c, row0, col0]
                op_hints = ["a_l2", "w_l2", "c", "row0", "col0"]
                partial = None
                if split:
                    partial = b.alloc([mb, nb], "f32", L2, "partial_l2")
                    ops.append(partial)
                    op_hints.append("partial_l2")
                with b.loop(0, K, tk2, "kc") as kc:
                    b.dma(a2, None, a, ([row0, kc], [mb, tk2], [K, 1]))
                    wf.stage(b, w2, w, s_bn, col0, kc)
                    with b.hierarchy("herd", list(herd), [*ops, kc], [*op_hints, "kc"]) as hh:
                        ids = hh.ids if m_axis == 0 else hh.ids[::-1]
                        _core(b, ids, hh.args, split, (K, N, tm, tn, tk, tk2, nb), wf)
                b.dealloc(a2, w2, *([partial] if partial is not None else []))
    return b.text()


def _core(b: Emitter, ids: tuple[Value, ...], hargs: tuple[Value, ...], split: bool, dims,
          wf: Bf16Weights) -> None:
    """One core's tile for one L2 step; `ids` are its (row, column) tile indices."""
    K, N, tm, tn, tk, tk2, nb = dims
    tx, ty = ids
    a2, w2, c, row0, col0 = hargs[:5]
    partial, kc = (hargs[5], hargs[6]) if split else (None, hargs[5])
    r, col = b.mul(tx, tm), b.mul(ty, tn)
    acc = b.alloc([tm, tn], "f32", L1, "acc")
    a1 = b.alloc([tm, tk], "bf16", L1, "a_l1")
    tiles = wf.tiles(b)
    out = b.alloc([tm, tn], "bf16", L1, "c_l1")
    tile_in_partial = ([r, col], [tm, tn], [nb, 1])

    def write_c() -> None:
        round_to_bf16(b, acc, out)
        b.dma(c, ([b.add(row0, r), b.add(col0, col)], [tm, tn], [N, 1]), out, None)

    zero = b.const(0.0, "f32")
    if split:
        with b.if_(b.cmp("eq", kc, 0)):
            b.fill(zero, acc)
        with b.else_():
            b.dma(acc, None, partial, tile_in_partial)
    else:
        b.fill(zero, acc)
    wf.walk(b, w2, ty, col, tiles, lambda kk: b.dma(a1, None, a2, ([r, kk], [tm, tk], [tk2, 1])),
            lambda w1: _matmul_acc(b, a1, w1, acc))
    if split:
        with b.if_(b.cmp("eq", kc, K - tk2)):
            write_c()
        with b.else_():
            b.dma(partial, tile_in_partial, acc, None)
    else:
        write_c()
    b.dealloc(acc, a1, *tiles, out)
