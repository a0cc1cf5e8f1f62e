"""Prefill attention output and MLP: O GEMM, residual add, RMSNorm, gate/up GEMMs, SwiGLU, down
GEMM and the second residual, one module, so the seven intermediates never reach the host.
"""
from __future__ import annotations

from kernel_builder.groups import KernelGroup
from multi_launch_builder import assemble

KIND = "o_ffn"


def build(group: KernelGroup) -> str:
    if group.kind != KIND:
        raise ValueError(f"{__name__} builds {KIND} groups, not {group.kind}")
    return assemble(group)
