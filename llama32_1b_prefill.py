"""Prefill: the prompt through every layer as 3 device calls, then the first token's logits.

Per layer: `rms_gemms_rope` (RMSNorm, Q/K/V projections, RoPE) → K and V into the head-major
KV cache → `flash_attn` (causal GQA over the chunk) → `o_ffn` (O projection, residual, RMSNorm,
SwiGLU MLP, residual). The prompt is padded to the smallest compiled bucket that holds it and
its real length is passed explicitly: the host writes and reads only the real rows, and
causality guarantees the padding never reaches them.
"""
from __future__ import annotations

from typing import Callable

import torch

from llama_runtime.device_model import DeviceModel, bo_key

# capture(layer, name, tensor): verification hooks; tensors are views, copy what you keep.
Capture = Callable[[int, str, torch.Tensor], None]


def prefill_layer(model: DeviceModel, layer: int, x: torch.Tensor, start: int, n: int, bucket: int,
                  capture: Capture | None = None) -> torch.Tensor:
    """One transformer block on rows [0, n) of the bucket; returns the block's output rows."""
    kc, g = model.kc, model.prefill_groups[bucket]
    lut = model.rope_lut[start:start + n]
    qkv = kc.load_and_run(g.rms_gemms_rope.name, {"x": x, "rope_lut": lut}, bo_key(g.rms_gemms_rope, layer), rows=n)
    with model.profiler.host_op("kv_write"):
        model.kv.write(layer, start, qkv["k"], qkv["v"])
    att = kc.load_and_run(g.flash_attn.name, {"q": qkv["q"], "k": qkv["k"], "v": qkv["v"]},
                          bo_key(g.flash_attn, layer), rows=n)
    if capture:
        for name in ("q", "k", "v"):
            capture(layer, name, qkv[name])
        capture(layer, "attn", att["attn"])
    out = kc.load_and_run(g.o_ffn.name, {"attn": att["attn"], "x_res": x}, bo_key(g.o_ffn, layer), rows=n)["out"]
    if capture:
        capture(layer, "out", out)
    return out


def prefill(model: DeviceModel, tokens: list[int], start: int = 0, capture: Capture | None = None) -> torch.Tensor:
    """Run the prompt `tokens` (real length len(tokens)) at positions start..; return f32 logits of its last token."""
    n = len(tokens)
    if n == 0:
        raise ValueError("prefill needs at least one token")
    if start != 0:
        raise NotImplementedError("prefill at an offset needs the offset attention group")
    bucket = model.bucket_for(n)
    x = model.embed_tokens(tokens)
    for layer in range(model.config.num_hidden_layers):
        x = prefill_layer(model, layer, x, start, n, bucket, capture)
    if capture:
        capture(-1, "final_hidden", x[n - 1])
    return model.logits(x[n - 1])
