"""Prefill attention: the single flash-attention launch, kept in a module of its own.

Stitched next to other launches its compile time explodes (see `group_options`), so it goes
through the same assembly path alone, which still gives it prefixed names and the
declaration cross-check.
"""
from __future__ import annotations

from kernel_builder.groups import KernelGroup
from multi_launch_builder import assemble

KIND = "flash_attn"


def build(group: KernelGroup) -> str:
    if group.kind != KIND:
        raise ValueError(f"{__name__} builds {KIND} groups, not {group.kind}")
    return assemble(group)
