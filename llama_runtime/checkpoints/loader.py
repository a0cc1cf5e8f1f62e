"""Checkpoint loading: a folder of safetensors (resolved from a path, repo id or alias) into
the `LlamaWeights` the device model uploads.

Shards are memory-mapped and every tensor is checked against the shape the config implies, so
a truncated or wrong-shape checkpoint fails with one line naming the tensor.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llama_base.weight_formats import QUANTS
from llama_base.config import LlamaConfig, layer_shapes
from llama_base.errors import CheckpointError, UserError
from llama_base.tensor_names import EMBED, FINAL_NORM, LAYER_TENSORS, LM_HEAD, layer_tensor
from llama_runtime.checkpoints.resolve import resolve_checkpoint
from llama_runtime.checkpoints.q4nx_weights import load_q4nx
from llama_runtime.checkpoints.safetensors_io import Checkpoint
from llama_runtime.checkpoints.weights import LayerWeights, LlamaWeights


def load_weights(source: str | Path, quant: str = "bf16", log: Callable[[str], None] = print) -> LlamaWeights:
    """Load a checkpoint folder; see `llama_runtime.checkpoints.resolve.resolve_checkpoint` for repo ids and
    defaults. With `quant="q4nx"` the linear weights come from the Q4NX cache (made on first use)."""
    if quant not in QUANTS:
        raise UserError(f"unknown weight format QUANT={quant!r}: expected one of {', '.join(QUANTS)}")
    folder = resolve_checkpoint(source, log, quant)
    weights = _load_bf16(folder)
    return weights if quant == "bf16" else load_q4nx(folder, weights, log)


def _load_bf16(folder: Path) -> LlamaWeights:
    cfg = LlamaConfig.from_json(folder)
    ckpt = Checkpoint(folder)
    h, v = cfg.hidden_size, cfg.vocab_size
    embed = ckpt.get(EMBED, (v, h))
    if cfg.tie_word_embeddings or LM_HEAD not in ckpt:
        if not cfg.tie_word_embeddings:
            raise CheckpointError(f"{folder}: tensor {LM_HEAD!r} is missing and embeddings are not tied")
        lm_head = embed
    else:
        lm_head = ckpt.get(LM_HEAD, (v, h))
    shapes = layer_shapes(cfg)
    layers = [
        LayerWeights(**{n: ckpt.get(layer_tensor(i, n), shapes[n]) for n in LAYER_TENSORS})
        for i in range(cfg.num_hidden_layers)
    ]
    return LlamaWeights(cfg, embed, ckpt.get(FINAL_NORM, (h,)), lm_head, layers, str(folder), ckpt)
