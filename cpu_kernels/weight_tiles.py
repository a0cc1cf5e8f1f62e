"""How the simulated device holds a weight matrix: in 16×2 tiles, each bf16 packed losslessly in 12 bits.

Tiles: W[N][K] (bf16, row-major on the host) is ordered [N/16][K/2][16][2], element (n, k) at
block n // 16, pair k // 2, lane n % 16, half k % 2. One 64-byte tile vector then holds a
K-pair of 16 outputs, which is what the CPU's bf16 dot-product instruction consumes (AVX2 widens
the same vector to f32 in registers: `native/simd_bf16.h`).

Packing: decode reads every weight once per token and waits on memory for almost all of it, so
a weight's bytes set the token rate. A matrix's values use few exponents (its 8 most used
exponent pairs hold all but 1e-4 to 1e-3 of them), so each value keeps its bf16 low byte as it is
and a 4-bit nibble (sign, which pair) for the high byte; a unit of 64 values with any other
exponent is kept whole. The native kernels rebuild a vector with one table lookup and one byte
interleave while its bytes arrive, and the products are those of the bf16 values: what the
device computes does not change, it reads 3/4 of the bytes. `native/packed_tiles.h` has the
byte layout; `from_packed` below reads it independently of the C++.

Why the device and not the host: prefill's GEMM is compute-bound and wants the weights in a
layout its register tile streams; decode's GEMV is memory-bound and wants each weight read
once, in order, in as few bytes as possible. A second copy for either would cost the memory of
every weight again, so the simulated device keeps one, packed, converting when a BO is synced,
much as an NPU's DMA re-tiles what it moves. The host never sees it: BOs are written and read
row-major, and the NPU path does not change.

The simulated device packs a weight when the kernel it is allocated for only reads it, as the
weight of GEMMs and GEMVs, and when native kernels of any ISA class are there to read it
(`npu_runtime.sim.packing`): the format is the same on every class, so the AVX2 path keeps
weights in 12 bits too.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cpu_kernels import native_cpu
from llama_base import q4nx

LANES = 16                       # outputs per block: one vector of 16 f32 sums
HEADER = 64                      # bytes: 8 exponent pairs, int64 escaped units, n, k
UNIT_BYTES = 96                  # two tile vectors: 32 bytes of nibbles, 64 low bytes
UNIT_VALUES = 64


def to_tiles(w: torch.Tensor) -> torch.Tensor:
    """The tiled order of a row-major [N, K] matrix, as [N/16, K/2, 16, 2]."""
    n, k = w.shape
    return w.reshape(n // LANES, LANES, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def from_tiles(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The row-major [N, K] matrix a tiled buffer holds."""
    return t.view(n // LANES, k // 2, LANES, 2).permute(0, 2, 1, 3).reshape(n, k)


def from_packed(buf: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The row-major [N, K] bf16 matrix a packed buffer (uint8) holds."""
    escapes, hn, hk = buf[8:32].view(torch.int64).tolist()
    if (hn, hk) != (n, k):
        raise ValueError(f"packed weight holds [{hn}, {hk}], not [{n}, {k}]")
    pairs = buf[:8].to(torch.int32)                   # nibble & 7 -> exponent >> 1
    blocks, units = n // LANES, k // 4
    words = (units + 63) // 64
    at = HEADER + blocks * units * UNIT_BYTES
    unit = buf[HEADER:at].view(blocks, units, 3, 32).to(torch.int32)
    bitmap = buf[at:at + blocks * words * 8].view(torch.int64).view(blocks, words)
    at += blocks * words * 8 + (blocks + 1) * 8       # past the per-block starts: order suffices here
    raw = buf[at:at + escapes * UNIT_VALUES * 2].view(torch.int16).view(escapes, 2, 32)

    e = torch.arange(32)
    q = (e & 0b00111) | ((e & 0b01000) << 1) | ((e & 0b10000) >> 1)    # element e's byte: bits 3, 4 swapped
    nibble = torch.stack([unit[:, :, 0] & 15, unit[:, :, 0] >> 4], dim=2)[..., q]    # [blocks, units, A|B, 32]
    low = unit[:, :, 1:][..., q]
    bits = ((nibble >> 3) << 15) | (pairs[nibble & 7] << 8) | low
    values = (bits - ((bits & 0x8000) << 1)).to(torch.int16)
    u = torch.arange(units)
    escaped = ((bitmap[:, u // 64] >> (u % 64)) & 1).bool()
    values[escaped] = raw                      # escaped units are stored in block, then unit order
    return from_tiles(values.view(torch.bfloat16), n, k)


@dataclass(frozen=True)
class Packing:
    """A BO's device-side layout: a bf16 [n, k] weight in packed tiles."""

    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.n * self.k * 2

    def pack(self, buf: torch.Tensor, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """A BO's row-major bytes (uint8) packed into a buffer from `alloc(nbytes)`."""
        out = native_cpu.pack_weight(buf.view(torch.bfloat16).view(self.n, self.k), alloc)
        if out is None:      # packing_for chose this layout only where the native kernels run
            raise RuntimeError("packed weights need the native kernels")
        return out

    def unpack(self, dev: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The BO's row-major bytes from its device copy, written into `out`."""
        out.view(torch.bfloat16).view(self.n, self.k).copy_(from_packed(dev, self.n, self.k))
        return out


class PackedWeight:
    """A packed weight as a kernel sees it: the device bytes and the matrix they hold."""

    __slots__ = ("data", "n", "k")

    def __init__(self, data: torch.Tensor, n: int, k: int):
        self.data, self.n, self.k = data, n, k

    def dense(self) -> torch.Tensor:
        """Row-major, for kernels without a packed form (a copy)."""
        return from_packed(self.data, self.n, self.k)


def dense(w: torch.Tensor | PackedWeight) -> torch.Tensor:
    return w.dense() if isinstance(w, PackedWeight) else w


# ---- Q4NX -------------------------------------------------------------------------------------
#
# A Q4NX weight keeps its bytes and its size on the simulated device, rearranged for a CPU that
# streams it: each group (32 columns of a row-block) becomes one contiguous run of its values,
# its scales and its mins (640 bytes), and the values (512 bytes: 32 columns of 16) are held in
# units of 4 columns with the columns innermost: unit byte 4 i + t is column t's byte i (rows i
# and i + 16). Then one 32-bit lane of a vector holds one row's values for 4 consecutive
# columns, which is what the CPU's byte dot products (vpdpbusd, vpmaddubsw) multiply against 4
# activations: the GEMV needs no shuffle, where the declared column-major order needs a
# cross-lane interleave of every column pair; and a row-block is read as one forward stream,
# where the declared order sends three (values, scales, mins) through each block, which the
# hardware prefetchers follow at two thirds of the bandwidth of one.
_UNIT_COLS = 4


def _regroup(src: torch.Tensor, dst: torch.Tensor, n: int, k: int, to_device: bool) -> torch.Tensor:
    layout = q4nx.Layout(n, k)
    units, per_col = q4nx.GROUP // _UNIT_COLS, q4nx.NIBBLE_BYTES_PER_COL
    group_bytes = q4nx.GROUP * q4nx.BYTES_PER_COL
    declared = (src if to_device else dst).view(layout.row_blocks, layout.row_block_bytes)
    device = (dst if to_device else src).view(layout.row_blocks, k // q4nx.GROUP, group_bytes)
    vals, aux = units * _UNIT_COLS * per_col, q4nx.ROWS * 2      # per group: value bytes, scale (min) bytes
    for c0, c in layout.col_blocks():
        g0, g, at = c0 // q4nx.GROUP, c // q4nx.GROUP, c0 * q4nx.BYTES_PER_COL
        ends = at + g * vals, at + g * (vals + aux), at + g * (vals + 2 * aux)
        declared_parts = (declared[:, at:ends[0]].view(-1, g, units, _UNIT_COLS, per_col).transpose(3, 4),
                          declared[:, ends[0]:ends[1]].view(-1, g, aux),
                          declared[:, ends[1]:ends[2]].view(-1, g, aux))
        grp = device[:, g0:g0 + g]
        device_parts = (grp[..., :vals].view(-1, g, units, per_col, _UNIT_COLS), grp[..., vals:vals + aux],
                        grp[..., vals + aux:])
        for d, v in zip(declared_parts, device_parts):
            (v if to_device else d).copy_(d if to_device else v)
    return dst


@dataclass(frozen=True)
class Q4nxPacking:
    """A BO's device-side layout: a Q4NX [n, k] weight with each group's values in 4-column units."""

    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return q4nx.nbytes(self.n, self.k)

    def pack(self, buf: torch.Tensor, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return _regroup(buf, alloc(self.nbytes), self.n, self.k, to_device=True)

    def unpack(self, dev: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return _regroup(dev, out, self.n, self.k, to_device=False)


class DeviceQ4nx:
    """A Q4NX weight as a kernel sees it on the simulated device: the device-form bytes."""

    __slots__ = ("data", "n", "k")

    def __init__(self, data: torch.Tensor, n: int, k: int):
        self.data, self.n, self.k = data, n, k

    def declared(self) -> torch.Tensor:
        """The Q4NX bytes as declared, for kernels without a device-form path (a copy)."""
        return _regroup(self.data, torch.empty_like(self.data), self.n, self.k, to_device=False)


def declared_q4nx(w: torch.Tensor | DeviceQ4nx) -> torch.Tensor:
    return w.declared() if isinstance(w, DeviceQ4nx) else w
