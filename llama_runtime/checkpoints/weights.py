"""A model's weights in memory, as the device model uploads them.

`load_weights` (llama_runtime.checkpoints.loader) fills these from a checkpoint; `synthetic_weights` makes
random ones for tests and for the Llama-3.2-1B-shape checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llama_base.config import LlamaConfig, layer_shapes
from llama_base.tensor_names import LAYER_TENSORS
from llama_runtime.checkpoints.safetensors_io import Checkpoint


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    def by_name(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in LAYER_TENSORS}


@dataclass
class LlamaWeights:
    config: LlamaConfig
    embed: torch.Tensor          # [vocab, hidden]
    final_norm: torch.Tensor     # [hidden]
    lm_head: torch.Tensor        # [vocab, hidden]; the embedding itself when tied
    layers: list[LayerWeights]
    source: str = ""
    checkpoint: Checkpoint | None = None   # the mapping behind the tensors, when loaded from disk
    quant: str = "bf16"          # the linear weights' format: bf16 tensors, or a quantized format's bytes
    backing: "LlamaWeights | None" = None  # the bf16 weights a quantized model takes its norms and embedding from

    def release_pages(self) -> None:
        """Let the OS drop file pages already copied elsewhere (see `Checkpoint.release_pages`)."""
        if self.checkpoint is not None:
            self.checkpoint.release_pages()
        if self.backing is not None:
            self.backing.release_pages()

    def wide(self, layer: int) -> frozenset[str]:
        """The linear weights of `layer` a quantized model holds in bf16 all the same (a GGUF's
        wider tensors, `q4nx_weights`): the groups of that layer keep them wide too. Empty in a
        bf16 model, whose weights are all that format."""
        if self.quant == "bf16":
            return frozenset()
        return frozenset(n for n, t in self.layers[layer].by_name().items() if t.dim() == 2)

    def wide_sets(self) -> tuple[frozenset[str], ...]:
        """The distinct `wide` sets of the layers, in layer order: one group variant each."""
        return tuple(dict.fromkeys(self.wide(i) for i in range(len(self.layers))))

    def nbytes(self) -> int:
        """Bytes of distinct tensors as held (a tied LM head counts once)."""
        tensors = [self.embed, self.final_norm] + [t for lw in self.layers for t in lw.by_name().values()]
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            tensors.append(self.lm_head)
        return sum(t.numel() * t.element_size() for t in tensors)


def synthetic_weights(config: LlamaConfig, seed: int = 0) -> LlamaWeights:
    """Random bf16 weights with HF's init scale (std 0.02), for tests; norms near 1 so they matter."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)

    shapes = layer_shapes(config)
    layers = [
        LayerWeights(**{n: norm(s[0]) if len(s) == 1 else rnd(*s) for n, s in shapes.items()})
        for _ in range(config.num_hidden_layers)
    ]
    embed = rnd(config.vocab_size, config.hidden_size)
    lm_head = embed if config.tie_word_embeddings else rnd(config.vocab_size, config.hidden_size)
    return LlamaWeights(config, embed, norm(config.hidden_size), lm_head, layers, f"synthetic(seed={seed})")
