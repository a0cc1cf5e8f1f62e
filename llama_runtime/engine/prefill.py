"""Prefill: the prompt through every layer as 3 device calls, then the first token's logits.

Per layer: `rms_gemms_rope` (RMSNorm, Q/K/V projections, RoPE) → K and V into the head-major
KV cache → `flash_attn` (causal GQA of the chunk over the cache) → `o_ffn` (O projection,
residual, RMSNorm, SwiGLU MLP, residual). A chunk is padded to the smallest compiled bucket
that holds it and its real length is passed explicitly: the host writes and reads only the
real rows, and causality guarantees the padding never reaches them. A prompt longer than the
largest bucket, or a chat turn after earlier ones, is prefilled at an offset: its queries
attend to the cached positions before it plus itself.

The last layer's outputs feed nothing but the next token's logits, so only the prompt's last
row goes past its K/V: that row finishes the layer the way decode does (host attention, then
`o_gemv_ffn`), which skips one layer's O projection and MLP over the prompt; earlier chunks of
a long prompt stop at the last layer's K/V. With a capture hook (per-layer diagnosis) every row
runs every layer.

With the fused decode (`DeviceModel.resident`) the KV cache lives on the device: a layer's
attention group appends the chunk's K/V rows to it and attends over it in one call (padding
rows land past the real ones, where the next token overwrites them before anything reads
them), and the last layer runs whole, there being no host copy of the cache to attend over.
"""
from __future__ import annotations

import torch

from cpu_kernels import threads
from llama_runtime.engine.decode import attend_and_ffn
from llama_base.errors import PromptError
from llama_runtime.engine.device_model import Capture, DeviceModel, bo_key


def _qkv(model: DeviceModel, layer: int, x: torch.Tensor, start: int, n: int, bucket: int) -> dict[str, torch.Tensor]:
    """`rms_gemms_rope` on rows [0, n) at positions start..: their Q/K/V."""
    g = model.prefill_groups[bucket][layer].rms_gemms_rope
    return model.kc.load_and_run(g.name, {"x": x, "rope_lut": model.rope_lut[start:start + n]}, bo_key(g, layer),
                                 rows=n)


def qkv_to_cache(model: DeviceModel, layer: int, x: torch.Tensor, start: int, n: int,
                 bucket: int) -> dict[str, torch.Tensor]:
    """`rms_gemms_rope` on rows [0, n), their K/V written to the cache at start..; returns Q/K/V."""
    qkv = _qkv(model, layer, x, start, n, bucket)
    with model.profiler.host_op("kv_write"):
        model.kv.write(layer, start, qkv["k"], qkv["v"])
    return qkv


def _attend_resident(model: DeviceModel, layer: int, x: torch.Tensor, start: int, n: int,
                     bucket: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`rms_gemms_rope`, then the resident attention group: its K/V rows appended to the
    device's cache at `start` and the chunk's attention over it, with no host copy between."""
    qkv = _qkv(model, layer, x, start, n, bucket)
    ga = model.attention_group(bucket, start, n)
    att = model.kc.load_and_run(ga.name, {"q": qkv["q"], "k": qkv["k"], "v": qkv["v"],
                                    "q_start": torch.tensor([start], dtype=torch.int32)}, bo_key(ga, layer), rows=n)
    return qkv, att


def prefill_layer(model: DeviceModel, layer: int, x: torch.Tensor, start: int, n: int, bucket: int,
                  capture: Capture | None = None) -> torch.Tensor:
    """One transformer block on rows [0, n) of the bucket at positions start..; returns its output rows."""
    threads.tick("prefill layer")     # a long prompt's layers follow the free cores as a token does
    kc, g = model.kc, model.prefill_groups[bucket][layer]
    if model.resident:
        qkv, att = _attend_resident(model, layer, x, start, n, bucket)
    else:
        qkv = qkv_to_cache(model, layer, x, start, n, bucket)
        ga = model.attention_group(bucket, start, n)
        # Only the positions written so far: the cache's later ones stay untouched (`context`).
        end = start + n
        att = kc.load_and_run(ga.name, {"q": qkv["q"], "k_cache": model.kv.k[layer, :, :end],
                                        "v_cache": model.kv.v[layer, :, :end],
                                        "q_start": torch.tensor([start], dtype=torch.int32)},
                              bo_key(ga, layer), rows=n, context=end)
    if capture:
        for name in ("q", "k", "v"):
            capture(layer, name, qkv[name])
        capture(layer, "attn", att["attn"])
    out = kc.load_and_run(g.o_ffn.name, {"attn": att["attn"], "x_res": x}, bo_key(g.o_ffn, layer), rows=n)["out"]
    if capture:
        capture(layer, "out", out)
    return out


def prefill_chunk(model: DeviceModel, tokens: list[int], start: int, capture: Capture | None = None,
                  final: bool = True) -> torch.Tensor | None:
    """One bucket-sized chunk at positions start..; returns its last row's hidden state if `final`.

    A chunk that is not the prompt's last only has to leave its K/V in the cache.
    """
    n = len(tokens)
    bucket = model.bucket_for(n)
    x = model.embed_tokens(tokens)
    last = model.config.num_hidden_layers - 1
    for layer in range(last):
        x = prefill_layer(model, layer, x, start, n, bucket, capture)
    if capture or (model.resident and final):
        # The resident cache has no host copy to attend over: the last layer runs whole.
        return prefill_layer(model, last, x, start, n, bucket, capture)[n - 1]
    if model.resident:
        _attend_resident(model, last, x, start, n, bucket)      # the last layer's K/V appended
        return None
    qkv = qkv_to_cache(model, last, x, start, n, bucket)
    if not final:
        return None
    return attend_and_ffn(model, last, qkv["q"][n - 1], x[n - 1], start + n - 1)


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
    model.kv.invalidate(start)
    for i in range(0, n, step):
        chunk = tokens[i:i + step]
        last = prefill_chunk(model, chunk, pos, capture, final=i + step >= n)
        model.kv.hold(pos, chunk)
        pos += len(chunk)
    return model.logits(last, capture)
