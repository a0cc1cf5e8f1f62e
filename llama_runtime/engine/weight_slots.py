"""Which weight tensor fills each static slot of a group: the run side of the slot names.

It lives beside the model runtime, not with the declarations: a compiled kernel never depends
on where its weights come from, so this mapping must not be part of what keys the kernel cache.
"""
from __future__ import annotations

import torch

from llama_base.group_contract import KernelGroup, Role, split_layer_slot
from kernel_builder.fused_groups import FINAL_NORM_SLOT
from llama_base.tensor_names import LAYER_TENSORS


def static_tensors(group: KernelGroup, weights, layer: int | None, only: str | None = None) -> dict[str, torch.Tensor]:
    """The tensor behind every static slot of `group`, for one layer (or the LM head).

    Names are the contract: layer slots are named after `LAYER_TENSORS` (prefixed with their
    layer, `layer_slot`, in a group of every layer), LM-head slots are row partitions of the
    (possibly tied) LM head, zero-padded to the declared shape, and the final norm is its own.
    `only`: that one slot's.
    """
    out: dict[str, torch.Tensor] = {}
    for s in group.with_role(Role.STATIC):
        if only is not None and s.name != only:
            continue
        layered = split_layer_slot(s.name)
        if layered is not None and layered[1] in LAYER_TENSORS:      # a group of every layer's slots
            t = getattr(weights.layers[layered[0]], layered[1])
        elif s.name in LAYER_TENSORS:
            t = getattr(weights.layers[layer], s.name)
        elif s.name == FINAL_NORM_SLOT:
            t = weights.final_norm
        elif s.name.startswith("w_p"):
            i, rows = int(s.name[3:]), s.shape[0]
            # Rows of a quantized head are bytes of whole row-blocks (a partition is whole ones).
            per_row = s.nbytes // rows if s.quantized else 1
            t = weights.lm_head[i * rows * per_row:(i + 1) * rows * per_row]
            if t.shape[0] < rows * per_row:
                t = torch.cat([t, t.new_zeros((rows * per_row - t.shape[0],) + tuple(t.shape[1:]))])
        else:
            raise KeyError(f"no weight source for static slot {s.name!r} of {group.name}")
        if tuple(t.shape) != s.storage_shape or t.dtype != s.torch_dtype:
            raise ValueError(f"{group.name}.{s.name}: weight {tuple(t.shape)} {t.dtype} != declared "
                             f"{s.storage_shape} {s.torch_dtype} ({s.dtype})")
        out[s.name] = t
    return out
