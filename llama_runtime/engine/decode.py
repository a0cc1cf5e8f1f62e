"""Decode: one token through every layer as 2 device calls plus host attention.

Per layer: `rms_gemv_rope` (RMSNorm, Q/K/V GEMVs, RoPE at the token's position) → the new K/V
appended to the KV cache at `pos` and attention over positions 0..pos, one host op
(`KVCache.store_and_attend`) → `o_gemv_ffn` (O GEMV, residual, RMSNorm, SwiGLU GEMVs,
residual). Attention stays on the host because for one query it is a small, memory-bound read
of the cache that would otherwise need the whole cache in device buffers. Where the device
records its runs (`api.Recorder`), a token's layers and its LM head call are those same calls
replayed as one native program (`recording`): `decode_step` is the one place that chooses.

The fused decode (`DeviceModel.resident`, `DECODE=fused`) is one call a token instead, the
KV cache and attention on the device (`kernel_builder.fused_groups`); recorded the same way.
"""
from __future__ import annotations

import torch

from cpu_kernels import threads
from llama_runtime.engine.recording import DecodeProgram, decode_program
from llama_runtime.engine.device_model import Capture, DeviceModel, bo_key
from llama_runtime.engine.kv_cache import HOST_OP, decode_attention_cpu


def decode_layer(model: DeviceModel, layer: int, x: torch.Tensor, pos: int,
                 capture: Capture | None = None) -> torch.Tensor:
    g1 = model.decode_groups[layer]["rms_gemv_rope"]
    qkv = model.kc.load_and_run(g1.name, {"x": x, "rope_lut": model.rope_lut[pos]}, bo_key(g1, layer))
    with model.profiler.host_op(HOST_OP):
        attn = model.kv.store_and_attend(layer, pos, qkv["q"], qkv["k"], qkv["v"], model.config.num_attention_heads)
    return _ffn(model, layer, attn, x, capture)


def attend_and_ffn(model: DeviceModel, layer: int, q: torch.Tensor, x: torch.Tensor, pos: int,
                   capture: Capture | None = None) -> torch.Tensor:
    """The rest of a layer for one token whose K/V are already cached at `pos`: host attention,
    then `o_gemv_ffn` on its residual row `x`. Prefill ends with this, for the one row whose
    output anything reads."""
    with model.profiler.host_op("decode_attention"):
        attn = decode_attention_cpu(q, model.kv, layer, pos, model.config.num_attention_heads)
    return _ffn(model, layer, attn, x, capture)


def _ffn(model: DeviceModel, layer: int, attn: torch.Tensor, x: torch.Tensor, capture: Capture | None) -> torch.Tensor:
    if capture:
        capture(layer, "attn", attn)
    g2 = model.decode_groups[layer]["o_gemv_ffn"]
    out = model.kc.load_and_run(g2.name, {"attn": attn, "x_res": x}, bo_key(g2, layer))["out"]
    if capture:
        capture(layer, "out", out)
    return out


def decode_step(model: DeviceModel, token: int, pos: int, capture: Capture | None = None) -> torch.Tensor:
    """Feed `token` at position `pos` (= number of tokens already cached); f32 logits of the next
    token. The token's recorded program where there is one (a device that records, no
    verification hooks: `recording.decode_program`), else its calls one by one: the same calls,
    so the same numbers, cache and counters either way. With the fused decode, its one call
    (recorded or not); a fused token has no layer boundaries for a capture hook to see."""
    if pos >= model.max_context:
        raise IndexError(f"position {pos} is past the KV cache ({model.max_context} positions)")
    if model.resident and capture is not None:
        raise ValueError("a fused decode token is one device call: per-layer captures need DECODE=layers")
    threads.tick()     # the host's team sized to the cores free now (cpu_kernels.threads)
    program = decode_program(model, pos) if capture is None else None
    if program is not None:
        return _replayed(model, program, token, pos)
    if model.resident:
        return _fused_call(model, token, pos)
    return _call_by_call(model, token, pos, capture)


def _fused_call(model: DeviceModel, token: int, pos: int) -> torch.Tensor:
    """The fused group's one call: the token's row, its RoPE row and its position in; the
    final-normed row and the head's partitions out. The device appends its K/V."""
    g = model.fused_group(pos)
    x = model.embed_tokens([token])[0]
    model.kv.invalidate(pos)
    out = model.kc.load_and_run(g.name, {"x": x, "rope_lut": model.rope_lut[pos],
                                         "pos": torch.tensor([pos], dtype=torch.int32)}, bo_key(g, None))
    model.kv.hold(pos, [token])
    return model.head_logits(torch.cat([out[name] for name in model.head_parts()]), out["normed"])


def _replayed(model: DeviceModel, program: DecodeProgram, token: int, pos: int) -> torch.Tensor:
    # The row goes where the program's first call reads it, read there from the file if it can be.
    x = None if model.embed_into(token, program.row_in) else model.embed_tokens([token])[0]
    model.kv.invalidate(pos)
    normed, parts = program.run(x, pos, model.profiler)
    model.kv.hold(pos, [token])
    return model.head_logits(parts, normed)


def _call_by_call(model: DeviceModel, token: int, pos: int, capture: Capture | None) -> torch.Tensor:
    x = model.embed_tokens([token])[0]
    model.kv.invalidate(pos)
    for layer in range(model.config.num_hidden_layers):
        x = decode_layer(model, layer, x, pos, capture)
    model.kv.hold(pos, [token])
    return model.logits(x, capture)
