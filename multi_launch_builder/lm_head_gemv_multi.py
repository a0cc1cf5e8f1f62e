"""LM head: the vocabulary in `LM_HEAD_PARTITIONS` row blocks, one GEMV launch each.

The host concatenates the partitions' logits and drops the last block's zero padding.
"""
from __future__ import annotations

from kernel_builder.groups import KernelGroup
from multi_launch_builder import assemble

KIND = "lm_head_gemv"


def build(group: KernelGroup) -> str:
    if group.kind != KIND:
        raise ValueError(f"{__name__} builds {KIND} groups, not {group.kind}")
    return assemble(group)
