"""Group modules: one stitched MLIR-AIR module per kernel group, assembled from its declaration.

Every group is built the same way: one per-kernel module per launch (the launch's `op`
selects the builder), stitched with argument maps taken from the declaration. The per-group
files only name their group kind and say what the module is for; adding a launch to a
group in `groups.py` needs no change here.
"""
from __future__ import annotations

from kernel_builder.groups import KernelGroup
from kernel_builder.mlir import build_launch
from kernel_builder.stitching import stitch_group


def assemble(group: KernelGroup) -> str:
    """The group's stitched module as text (not yet validated: see `kernel_builder.compile`)."""
    return stitch_group(group, [build_launch(group, launch) for launch in group.launches])


def module_for(group: KernelGroup) -> str:
    """Dispatch through the group's own builder file, which checks the group kind it serves."""
    from multi_launch_builder import (flash_attn_module, lm_head_gemv_multi, o_ffn_multi,
                                      o_gemv_ffn_multi, rms_gemms_rope_multi, rms_gemv_rope_multi)

    by_kind = {m.KIND: m for m in (rms_gemms_rope_multi, flash_attn_module, o_ffn_multi,
                                   rms_gemv_rope_multi, o_gemv_ffn_multi, lm_head_gemv_multi)}
    try:
        return by_kind[group.kind].build(group)
    except KeyError:
        raise ValueError(f"no module builder for group kind {group.kind!r}") from None
