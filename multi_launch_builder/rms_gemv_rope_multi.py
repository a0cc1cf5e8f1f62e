"""Decode attention input: RMSNorm, the Q/K/V GEMVs and RoPE on Q and K for one token.
"""
from __future__ import annotations

from kernel_builder.groups import KernelGroup
from multi_launch_builder import assemble

KIND = "rms_gemv_rope"


def build(group: KernelGroup) -> str:
    if group.kind != KIND:
        raise ValueError(f"{__name__} builds {KIND} groups, not {group.kind}")
    return assemble(group)
