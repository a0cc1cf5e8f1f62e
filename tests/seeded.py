"""Random bf16 tensors that are the same in every run: the kernel tests compare bits, so their
inputs come from a seed of their own, never from the global generator another test moved."""
from __future__ import annotations

import torch


def rand_bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values times `scale`, rounded to bf16."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)
