"""The RoPE table: per-position cos | sin rows, the static input of every RoPE launch."""
from __future__ import annotations

import math

import torch

from llama_base.config import LlamaConfig


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Per-pair inverse frequencies in f32, with Llama-3 scaling when the config asks for it."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def generate_rope_lut(config: LlamaConfig, max_seq: int, start: int = 0) -> torch.Tensor:
    """bf16 [max_seq, head_dim] rows for positions start.., each row cos(θ·p) | sin(θ·p) halves.

    Half-split layout: the RoPE kernel rotates element i with element i + head_dim/2 by the
    angle in column i, so one contiguous row per position is all it reads.
    """
    pos = torch.arange(start, start + max_seq, dtype=torch.float32)
    ang = pos[:, None] * rope_inv_freq(config)[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).to(torch.bfloat16)
