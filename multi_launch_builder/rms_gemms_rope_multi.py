"""Prefill attention input: RMSNorm, the Q/K/V GEMMs and RoPE on Q and K, one module.

Q, K and V leave as outputs (K/V go to the host's cache); `normed`, `q_raw` and `k_raw` stay
on the device between launches, which is why they are one module.
"""
from __future__ import annotations

from kernel_builder.groups import KernelGroup
from multi_launch_builder import assemble

KIND = "rms_gemms_rope"


def build(group: KernelGroup) -> str:
    if group.kind != KIND:
        raise ValueError(f"{__name__} builds {KIND} groups, not {group.kind}")
    return assemble(group)
