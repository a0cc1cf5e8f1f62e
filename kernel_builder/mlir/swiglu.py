"""SwiGLU activation, act = SiLU(gate) · up, through the external `silu_and_mul` kernel.

SiLU needs an exponential the compiler does not vectorise well on AIE2P, so the fused
elementwise step is hand-written C++; this module only streams chunks to it.
"""
from __future__ import annotations

from typing import Sequence

from kernel_builder import externs
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.emit import Emitter, Value, memref_parts
from kernel_builder.mlir.stream import build_stream


def _silu_mul(b: Emitter, gate: Value, up: Value, out: Value) -> None:
    tile = memref_parts(gate.type)[0][0]
    b.call(externs.silu_and_mul(tile), gate, up, out)


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    return build_stream(launch, slots, _silu_mul)
