"""Which of a group's buffers the simulated device holds packed, and in which layout.

The layouts are the CPU kernels' (`cpu_kernels.weight_tiles`); choosing one for a BO needs the
group's declaration, which is the simulator's to read.
"""
from __future__ import annotations

from cpu_kernels import native_cpu
from cpu_kernels.weight_tiles import HEADER, LANES, Packing, Q4nxPacking
from llama_base.group_contract import KernelGroup, Role

_WEIGHT_OPS = {"gemm", "gemv"}   # ops whose second operand is a [N, K] weight; both read it packed
_Q4NX_OPS = {"gemm_q4nx", "gemv_q4nx"}


def packing_for(group: KernelGroup, index: int) -> Packing | Q4nxPacking | None:
    """The layout a BO for the group's argument `index` should have on the simulated device.

    Packs only a static matrix that every launch using it reads as the weight of a GEMM or GEMV
    of its format, and only where the native kernels run and read that layout: a bf16 one with
    N a multiple of 16 and K of 4 into packed tiles, a Q4NX one into 4-column units.
    """
    slot = group.slots[index]
    if slot.role is not Role.STATIC or len(slot.shape) != 2 or not native_cpu.available():
        return None
    ops = _Q4NX_OPS if slot.quantized else _WEIGHT_OPS
    uses = [l for l in group.launches if slot.name in l.args]
    if not uses or any(l.op not in ops or l.args.index(slot.name) != 1 or slot.name in l.writes for l in uses):
        return None
    if slot.quantized:
        return Q4nxPacking(*slot.shape)
    if (slot.dtype != "bf16" or not native_cpu.tileable(*slot.shape) or native_cpu.tile_rows() != LANES
            or native_cpu.packed_header() != HEADER):
        return None
    return Packing(*slot.shape)
