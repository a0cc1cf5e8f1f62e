"""Decode attention output and MLP for one token: the GEMV form of `o_ffn_multi`.
"""
from __future__ import annotations

from kernel_builder.groups import KernelGroup
from multi_launch_builder import assemble

KIND = "o_gemv_ffn"


def build(group: KernelGroup) -> str:
    if group.kind != KIND:
        raise ValueError(f"{__name__} builds {KIND} groups, not {group.kind}")
    return assemble(group)
