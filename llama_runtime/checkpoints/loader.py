"""Checkpoint loading: a resolved model's folder of safetensors into the `LlamaWeights` the
device model uploads, in bf16 or with its linear weights in Q4NX.

Shards are memory-mapped and every tensor is checked against the shape the config implies, so
a truncated or wrong-shape checkpoint fails with one line naming the tensor.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llama_base.config import layer_shapes
from llama_base.errors import CheckpointError
from llama_base.tensor_names import EMBED, FINAL_NORM, LAYER_TENSORS, LM_HEAD, layer_tensor
from llama_runtime.checkpoints.resolve import ResolvedModel, check_quant, resolve_checkpoint
from llama_runtime.checkpoints.q4nx_weights import load_q4nx
from llama_runtime.checkpoints.safetensors_io import Checkpoint
from llama_runtime.checkpoints.weights import LayerWeights, LlamaWeights


def load_weights(model: ResolvedModel | str | Path, quant: str = "bf16",
                 log: Callable[[str], None] = print) -> LlamaWeights:
    """The weights of `model` in the weight format `quant`. A run passes the model it resolved
    (`resolve.resolve_model`); a path, repo id or alias is resolved here, once. With
    `quant="q4nx"` the linear weights come from the Q4NX cache (made on first use)."""
    check_quant(quant)
    resolved = model if isinstance(model, ResolvedModel) else resolve_checkpoint(model, log, quant)
    weights = _load_bf16(resolved)
    return weights if quant == "bf16" else load_q4nx(resolved.folder, resolved.gguf, weights, log)


def _load_bf16(model: ResolvedModel) -> LlamaWeights:
    folder, cfg = model.folder, model.config
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
