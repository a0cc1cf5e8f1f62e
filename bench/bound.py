"""What a decode step must read, from the model's config, and the speed limit that sets.

A single-token decode step multiplies one activation row by every linear weight of every layer
and by the LM head, so each step streams all of those bytes from memory once; everything else
it reads (norm weights, one embedding row, the KV cache at short contexts) is small beside
them. Bytes per token ÷ memory bandwidth is therefore the fastest a memory-bound decode can
go. A tied embedding is the LM head: it is counted once, as the head, plus the one row the
embedding lookup reads. Sizes come from the config only, so the same arithmetic serves the
1B shape, SmolLM2 and a 3B config. With Q4NX weights the linear weights and the LM head are
counted at their Q4NX size (the head's rows padded as stored), the embedding row at bf16.
"""
from __future__ import annotations

from kernel_builder.backend_presets import BF16
from llama_base.config import LlamaConfig, layer_shapes
from llama_runtime.checkpoints.loader import device_weight_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_bytes(cfg: LlamaConfig) -> int:
    """bf16 bytes of every distinct tensor of the checkpoint (a tied LM head counts once)."""
    per_layer = sum(_numel(s) for s in layer_shapes(cfg).values())
    table = cfg.vocab_size * cfg.hidden_size
    heads = table if cfg.tie_word_embeddings else 2 * table
    return (cfg.num_hidden_layers * per_layer + heads + cfg.hidden_size) * BF16


def decode_bytes_per_token(cfg: LlamaConfig, quant: str = "bf16") -> int:
    """Bytes one decode step reads in weight format `quant`: all linear weights, the LM head, one
    embedding row."""
    return device_weight_bytes(cfg, quant) + cfg.hidden_size * BF16


def decode_call_bytes(cfg: LlamaConfig, quant: str = "bf16") -> list[int]:
    """The weight bytes of each GEMV dispatch of one decode step on the simulated device, in
    order: each decode group's launches as the device plans them (`npu_runtime.sim.ops.plan`
    batches independent GEMVs into one native call: Q/K/V, gate and up, the head's partitions),
    layer after layer, then the LM head. Their sum is the step's linear weights and head as the
    groups declare them (the head's partitions padded to whole rows)."""
    from kernel_builder import groups
    from llama_base import group_contract
    from npu_runtime.sim.ops import plan

    def calls(kind: str) -> list[int]:
        group = groups.build_group(kind, cfg, 1, quant=quant)
        return [sum(group.slot(l.reads[1]).nbytes for l in step) for step in plan(group.launches)
                if isinstance(step, list)]

    layer = [b for kind in group_contract.DECODE_KINDS for b in calls(kind)]
    return layer * cfg.num_hidden_layers + calls("lm_head_gemv")


def kv_cache_bytes(cfg: LlamaConfig, positions: int) -> int:
    """bf16 K and V for every layer and KV head over `positions` positions."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * positions * cfg.head_dim * BF16


def decode_bound_tokens_per_s(bytes_per_token: int, bandwidth_bytes_per_s: float) -> float:
    return bandwidth_bytes_per_s / bytes_per_token
