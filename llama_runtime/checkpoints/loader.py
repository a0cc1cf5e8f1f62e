"""Checkpoint loading: a resolved model's folder of safetensors into the `LlamaWeights` the
device model uploads, in bf16 or with its linear weights in Q4NX.

Shards are memory-mapped and every tensor is checked against the shape the config implies, so
a truncated or wrong-shape checkpoint fails with one line naming the tensor.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from llama_base import q4nx
from llama_base.config import LlamaConfig, layer_shapes
from llama_base.errors import CheckpointError
from llama_base.tensor_names import EMBED, FINAL_NORM, LAYER_TENSORS, LM_HEAD, layer_tensor
from llama_runtime.checkpoints.resolve import ResolvedModel, check_quant, resolve_checkpoint
from llama_runtime.checkpoints.q4nx_weights import lm_head_rows, load_q4nx
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


def device_weight_bytes(cfg: LlamaConfig, quant: str = "bf16") -> int:
    """Bytes of the weights a decode step streams, as the format stores them: every layer's
    linear weights and the LM head (its rows padded as stored in a quantized format); the
    norms and the embedding table are read a row at a time and left out."""
    shapes = [s for s in layer_shapes(cfg).values() if len(s) == 2]
    if quant == q4nx.NAME:
        return (cfg.num_hidden_layers * sum(q4nx.nbytes(*s) for s in shapes)
                + q4nx.nbytes(lm_head_rows(cfg), cfg.hidden_size))
    params = cfg.num_hidden_layers * sum(n * k for n, k in shapes) + cfg.vocab_size * cfg.hidden_size
    return params * torch.bfloat16.itemsize


def check_fits(model: ResolvedModel, quant: str = "bf16") -> None:
    """A one-line `CheckpointError` before anything loads when the weights in `quant` need more
    memory than the machine has available now: a model that cannot fit would otherwise be
    killed minutes into its load (or its Q4NX build), with nothing said. What the device keeps
    may be less (the simulated device packs bf16 weights in 12 bits), so this refuses only a
    model whose weights as the format stores them do not fit."""
    need, free = device_weight_bytes(model.config, quant), psutil.virtual_memory().available
    if need > free:
        raise CheckpointError(f"{model.name}: its weights in {quant} need {need / 2**30:.2f} GiB "
                              f"(linear layers and LM head) and {free / 2**30:.2f} GiB are available"
                              + ("; QUANT=q4nx needs about a quarter of that" if quant == "bf16" else ""))


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
