"""The Hugging Face names of a Llama checkpoint's tensors, spelled here and nowhere else.

Every reader and writer of a checkpoint folder names its tensors this way: the loader, the GGUF
import (which translates llama.cpp's names into these), the built-in models, the Q4NX weights
(which keep the names of the matrices they hold) and the HF reference that swaps its weights.
The runtime's own short names, the keys of `LAYER_TENSORS`, are also the static slot names of
the kernel groups, which is how the KernelCache's preload finds each weight without a second
mapping table.
"""
from __future__ import annotations

import re

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_PREFIX = "model.layers."

# A layer's tensors: the runtime's short name -> the name within the layer.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_SHORT = {hf: short for short, hf in LAYER_TENSORS.items()}
_LAYER_RE = re.compile(re.escape(LAYER_PREFIX) + r"(\d+)\.(.+)")


def layer_tensor(layer: int, short: str) -> str:
    """The HF name of layer `layer`'s tensor `short` (a key of `LAYER_TENSORS`)."""
    return f"{LAYER_PREFIX}{layer}.{LAYER_TENSORS[short]}"


def parse_layer_tensor(name: str) -> tuple[int, str] | None:
    """(layer, short name) of a layer tensor's HF name; None for any other name."""
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _SHORT:
        return None
    return int(m.group(1)), _SHORT[m.group(2)]


def tensor_names(num_layers: int, tied: bool) -> list[str]:
    """Every weight a checkpoint of `num_layers` layers holds: no separate LM head when it is
    `tied` to the embedding."""
    names = [EMBED] + [layer_tensor(i, s) for i in range(num_layers) for s in LAYER_TENSORS] + [FINAL_NORM]
    return names if tied else names + [LM_HEAD]
