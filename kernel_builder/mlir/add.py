"""Residual add, out = a + b, in f32 then rounded once to bf16 (as torch adds bf16 tensors).

Plain linalg: the compiler vectorises it, so no external kernel is involved.
"""
from __future__ import annotations

from typing import Sequence

from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.emit import Emitter, Value
from kernel_builder.mlir.stream import build_stream

IDENTITY_1D = "affine_map<(d0) -> (d0)>"


def _add(b: Emitter, a: Value, c: Value, out: Value) -> None:
    def body(x: list[Value]) -> list[Value]:
        s = b.arith("addf", b.extf(x[0]), b.extf(x[1]), hint="sum")
        return [b.truncf(s)]

    b.generic([IDENTITY_1D] * 3, ["parallel"], [a, c], [out], body)


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    return build_stream(launch, slots, _add)
