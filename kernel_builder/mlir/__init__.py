"""Per-kernel MLIR-AIR builders: one module of text per `groups.Launch`.

`build_launch(group, launch)` is the only entry point the stitcher needs: the launch's `op`
selects the builder and the group supplies the slots behind the launch's arguments.
"""
from __future__ import annotations

from typing import Callable, Sequence

from llama_base.group_contract import KernelGroup, Launch, Slot
from kernel_builder.mlir import (add, decode_attention, flash_attention, gemm, gemm_q4nx, gemv, gemv_q4nx, kv_append,
                                 rmsnorm, rope, swiglu)
from kernel_builder.mlir.common import KernelShapeError

Builder = Callable[[Launch, Sequence[Slot]], str]

BUILDERS: dict[str, Builder] = {
    "rmsnorm": rmsnorm.build,
    "gemm": gemm.build,
    "gemv": gemv.build,
    "gemm_q4nx": gemm_q4nx.build,
    "gemv_q4nx": gemv_q4nx.build,
    "rope": rope.build,
    "swiglu": swiglu.build,
    "add": add.build,
    "flash_attn": flash_attention.build,
    "kv_append": kv_append.build,
    "decode_attn": decode_attention.build,
    "attn_merge": decode_attention.build_merge,
}


def build_launch(group: KernelGroup, launch: Launch) -> str:
    try:
        builder = BUILDERS[launch.op]
    except KeyError:
        raise KernelShapeError(f"{group.name}: no MLIR builder for op {launch.op!r}") from None
    return builder(launch, [group.slot(a) for a in launch.args])


__all__ = ["BUILDERS", "Builder", "KernelShapeError", "build_launch"]
