"""How the simulated device holds a weight matrix: in 16×2 tiles that its GEMM and GEMV both stream.

W[N][K] (bf16, row-major on the host) lives on the simulated device as [N/16][K/2][16][2]:
element (n, k) at block n // 16, pair k // 2, lane n % 16, half k % 2. One 64-byte vector then
holds a K-pair of 16 outputs, which is what the CPU's bf16 dot-product instruction consumes.

Why the device and not the host: prefill's GEMM is compute-bound and wants the weights in a
layout its register tile streams; decode's GEMV is memory-bound and wants each weight read
once, in order. The row-major layout serves the GEMV only, and a second, packed copy for the
GEMM would cost the memory of every weight again. So the simulated device keeps one copy, in
this layout, converting when a BO is synced, much as an NPU's DMA re-tiles what it moves. The
host never sees it: BOs are written and read row-major, and the NPU path does not change.

A weight is tiled when the kernel it is allocated for only reads it, as the weight of GEMMs and
GEMVs, and when the native kernels are there to read tiles (`tiling_for`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernel_builder import native_cpu
from kernel_builder.groups import KernelGroup, Role

LANES = 16                       # outputs per block: one vector of 16 f32 sums
_WEIGHT_OPS = {"gemm", "gemv"}   # ops whose second operand is a [N, K] weight; both read tiles


def to_tiles(w: torch.Tensor) -> torch.Tensor:
    """The tiled form of a row-major [N, K] matrix (the layout's definition), as [N/16, K/2, 16, 2]."""
    n, k = w.shape
    return w.reshape(n // LANES, LANES, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def from_tiles(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The row-major [N, K] matrix a tiled buffer holds."""
    return t.view(n // LANES, k // 2, LANES, 2).permute(0, 2, 1, 3).reshape(n, k)


@dataclass(frozen=True)
class Tiling:
    """A BO's device-side layout: a bf16 [n, k] weight in tiles."""

    n: int
    k: int

    def tile(self, buf: torch.Tensor) -> torch.Tensor:
        """A BO's row-major bytes (uint8) turned into tiles in place: a 16-row block occupies the
        same bytes in both layouts, so no second copy of the weight is needed."""
        dense = buf.view(torch.bfloat16).view(self.n, self.k)
        if not native_cpu.tile_weight(dense, dense):
            dense.view(-1).copy_(to_tiles(dense).view(-1))
        return buf

    def untile(self, dev: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The BO's row-major bytes from its device copy, written into `out`."""
        out.view(torch.bfloat16).view(self.n, self.k).copy_(from_tiles(dev.view(torch.bfloat16), self.n, self.k))
        return out


class TiledWeight:
    """A tiled weight as a kernel sees it: the device bytes and the matrix they hold."""

    __slots__ = ("data", "n", "k")

    def __init__(self, data: torch.Tensor, n: int, k: int):
        self.data, self.n, self.k = data.view(torch.bfloat16), n, k

    def dense(self) -> torch.Tensor:
        """Row-major, for kernels without a tiled form (a copy)."""
        return from_tiles(self.data, self.n, self.k)


def dense(w: torch.Tensor | TiledWeight) -> torch.Tensor:
    return w.dense() if isinstance(w, TiledWeight) else w


def tiling_for(group: KernelGroup, index: int) -> Tiling | None:
    """The layout a BO for the group's argument `index` should have on the simulated device.

    Tiles only a static bf16 matrix that every launch using it reads as a GEMM or GEMV weight,
    with N a multiple of 16 and K even, and only where the native kernels run and read this
    layout.
    """
    slot = group.slots[index]
    if (slot.role is not Role.STATIC or slot.dtype != "bf16" or len(slot.shape) != 2
            or not native_cpu.tileable(*slot.shape) or native_cpu.tile_rows() != LANES):
        return None
    uses = [l for l in group.launches if slot.name in l.args]
    if not uses or any(l.op not in _WEIGHT_OPS or l.args.index(slot.name) != 1 or slot.name in l.writes
                       for l in uses):
        return None
    return Tiling(*slot.shape)
