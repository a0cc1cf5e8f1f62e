"""Prefill: the prompt through every layer as 3 device calls, then the first token's logits.

Per layer: `rms_gemms_rope` (RMSNorm, Q/K/V projections, RoPE) → K and V into the head-major
KV cache → `flash_attn` (causal GQA of the chunk over the cache) → `o_ffn` (O projection,
residual, RMSNorm, SwiGLU MLP, residual). A chunk is padded to the smallest compiled bucket
that holds it and its real length is passed explicitly: the host writes and reads only the
real rows, and causality guarantees the padding never reaches them. A prompt longer than the
largest bucket, or a chat turn after earlier ones, is prefilled at an offset: its queries
attend to the cached positions before it plus itself.
"""
from __future__ import annotations

from typing import Callable

import torch

from llama_runtime.device_model import DeviceModel, bo_key
from llama_runtime.errors import PromptError

# capture(layer, name, tensor): verification hooks; tensors are views, copy what you keep.
Capture = Callable[[int, str, torch.Tensor], None]


def prefill_layer(model: DeviceModel, layer: int, x: torch.Tensor, start: int, n: int, bucket: int,
                  capture: Capture | None = None) -> torch.Tensor:
    """One transformer block on rows [0, n) of the bucket at positions start..; returns its output rows."""
    kc, g = model.kc, model.prefill_groups[bucket]
    lut = model.rope_lut[start:start + n]
    qkv = kc.load_and_run(g.rms_gemms_rope.name, {"x": x, "rope_lut": lut}, bo_key(g.rms_gemms_rope, layer), rows=n)
    with model.profiler.host_op("kv_write"):
        model.kv.write(layer, start, qkv["k"], qkv["v"])
    ga = model.attention_group(bucket, start, n)
    ctx = ga.ctx_len
    att = kc.load_and_run(ga.name, {"q": qkv["q"], "k_cache": model.kv.k[layer, :, :ctx],
                                    "v_cache": model.kv.v[layer, :, :ctx],
                                    "q_start": torch.tensor([start], dtype=torch.int32)},
                          bo_key(ga, layer), rows=n)
    if capture:
        for name in ("q", "k", "v"):
            capture(layer, name, qkv[name])
        capture(layer, "attn", att["attn"])
    out = kc.load_and_run(g.o_ffn.name, {"attn": att["attn"], "x_res": x}, bo_key(g.o_ffn, layer), rows=n)["out"]
    if capture:
        capture(layer, "out", out)
    return out


def prefill_chunk(model: DeviceModel, tokens: list[int], start: int, capture: Capture | None = None) -> torch.Tensor:
    """One bucket-sized chunk at positions start..; returns its last row's hidden state."""
    n = len(tokens)
    bucket = model.bucket_for(n)
    x = model.embed_tokens(tokens)
    for layer in range(model.config.num_hidden_layers):
        x = prefill_layer(model, layer, x, start, n, bucket, capture)
    return x[n - 1]


def prefill(model: DeviceModel, tokens: list[int], start: int = 0, capture: Capture | None = None) -> torch.Tensor:
    """Prefill `tokens` at positions start.. (KV of 0..start already cached); f32 logits of the last token.

    Prompts longer than the largest bucket go chunk by chunk; every chunk but the last is a
    full bucket, so the result equals a single-shot prefill wherever both are possible.
    """
    n = len(tokens)
    if n == 0:
        raise PromptError("the prompt is empty")
    if start + n > model.max_context:
        raise PromptError(f"{start + n} positions exceed the context limit of {model.max_context}")
    step = model.buckets[-1]
    pos = start
    for i in range(0, n, step):
        last = prefill_chunk(model, tokens[i:i + step], pos, capture)
        pos += len(tokens[i:i + step])
    return model.logits(last, capture)
