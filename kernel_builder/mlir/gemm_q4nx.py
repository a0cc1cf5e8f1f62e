"""Prefill GEMM on Q4NX weights, C[M,N] = A[M,K] · W[N,K]ᵀ: the bf16 GEMM fed dequantized tiles.

Params: as `gemm` (`M`, `N`, `K`, `herd`, `tile_m`, `tile_n`, `tile_k`, `tile_k_l2`), with
`tile_n` whole row-blocks (`q4nx.ROWS` rows), `tile_k` whole groups and `tile_k_l2` all of K or
whole Q4NX blocks (`backend_presets.q4nx_k_steps`).

Everything but W's path is `gemm.build_gemm`: the launch grid, the K steps through L2 with f32
partial sums, the linalg product. W moves as its Q4NX bytes all the way to the core (5/16 of
bf16's traffic), where an external kernel expands the tile to bf16 in L1 just before the product:
- L3→L2: the block's row-blocks, columns [kc, kc + tile_k_l2). Those are whole blocks, so each
  row-block's part is one contiguous run and the panel is itself a Q4NX [nb, tile_k_l2] matrix:
  one DMA, row-blocks strided by the matrix's row-block bytes.
- L2→L1: the core's row-blocks, columns [kk, kk + tile_k), which lie inside one panel block,
  become a Q4NX [tile_n, tile_k] tile: three DMAs (nibbles, scales, mins), each over the tile's
  row-blocks. A block's scales sit after all its nibbles at an offset that depends on the
  block's width, so the walk over a panel runs one loop per run of equal-width blocks (a row's
  last block is narrower when K is not a multiple of `q4nx.COLS`) and every offset is affine in
  the loop counters.
Every DMA moves whole 32-bit words at word-aligned byte offsets (columns come in multiples of
`q4nx.GROUP`, and every per-column byte count of the format is a multiple of 4 per group).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from itertools import groupby
from typing import Callable, Sequence

from kernel_builder import externs
from kernel_builder.backend_presets import gemm_q4nx_l1_bytes, gemm_q4nx_l2_bytes, q4nx_k_steps
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import Kernel
from kernel_builder.mlir.emit import L1, L2, Emitter, Index, Value
from kernel_builder.mlir.gemm import Bf16Weights, build_gemm
from llama_base import q4nx

NIB = q4nx.NIBBLE_BYTES_PER_COL                       # bytes of 4-bit values per column
SCALE = (q4nx.BYTES_PER_COL - NIB) // 2               # bytes of scales (and of mins) per column
BPC = q4nx.BYTES_PER_COL


@dataclass(frozen=True)
class Q4nxWeights(Bf16Weights):
    """W as Q4NX bytes: panels and core tiles are Q4NX matrices, dequantized on the core."""

    def check(self, k: Kernel, w_s: Slot) -> None:
        k.require(w_s.quantized, f"W slot {w_s.name} is {w_s.dtype}, not Q4NX")
        k.require(self.tn % q4nx.ROWS == 0 and self.tk % q4nx.GROUP == 0,
                  f"a {self.tn}x{self.tk} W tile is not whole row-blocks and groups")
        k.require(self.tk2 in q4nx_k_steps(self.K, self.tk),
                  f"tile_k_l2 {self.tk2} is not all of K={self.K} nor whole blocks that tile_k {self.tk} divides")

    def l1_bytes(self, tm: int) -> int:
        return gemm_q4nx_l1_bytes(tm, self.tn, self.tk)

    def l2_bytes(self, mb: int, split: bool) -> int:
        return gemm_q4nx_l2_bytes(mb, self.nb, self.tk2, split)

    def panel(self, b: Emitter) -> Value:
        return b.alloc([q4nx.nbytes(self.nb, self.tk2)], "i8", L2, "w_l2")

    def stage(self, b: Emitter, w2: Value, w: Value, bn: Index, col0: Index, kc: Index) -> None:
        rbs = self.nb // q4nx.ROWS
        b.dma(w2, None, w, ([b.mul(bn, rbs), b.mul(kc, BPC)], [rbs, BPC * self.tk2], [BPC * self.K, 1]))

    def tiles(self, b: Emitter) -> list[Value]:
        return [b.alloc([q4nx.nbytes(self.tn, self.tk)], "i8", L1, "wq_l1"),
                b.alloc([self.tn, self.tk], "bf16", L1, "w_l1")]

    def walk(self, b: Emitter, w2: Value, ty: Index, col: Index, tiles: list[Value],
             load_a: Callable[[Index], None], multiply: Callable[[Value], None]) -> None:
        wq, w1 = tiles
        tn, tk, tk2 = self.tn, self.tk, self.tk2
        rbs = tn // q4nx.ROWS
        first_rb = b.mul(ty, rbs)
        dequant = externs.dequant_q4nx(tn, tk)
        blocks = q4nx.Layout(q4nx.ROWS, tk2).col_blocks()
        for width, run in groupby(blocks, key=lambda blk: blk[1]):
            run = list(run)
            start = run[0][0]
            # A run of one block (a panel of one block, the narrower last one) needs no loop.
            with b.loop(0, len(run), 1, "blk") if len(run) > 1 else nullcontext(0) as j:
                c0 = b.add(start, b.mul(j, width))               # the block's first panel column
                base = b.mul(c0, BPC)                             # and its byte offset in a panel row-block
                with b.loop(0, width, tk, "kk") as kk:
                    load_a(b.add(c0, kk))
                    group_at = b.mul(kk, SCALE)                   # the tile's first scale (and min) byte
                    for src_at, dst_at, n in ((b.mul(kk, NIB), 0, NIB * tk),
                                              (b.add(width * NIB, group_at), NIB * tk, SCALE * tk),
                                              (b.add(width * (NIB + SCALE), group_at), (NIB + SCALE) * tk,
                                               SCALE * tk)):
                        b.dma(wq, ([0, dst_at], [rbs, n], [BPC * tk, 1]),
                              w2, ([first_rb, b.add(base, src_at)], [rbs, n], [BPC * tk2, 1]))
                    b.call(dequant, wq, w1)
                    multiply(w1)


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    return build_gemm(launch, slots, Q4nxWeights)
