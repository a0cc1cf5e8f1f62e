"""The bf16 twin of a Q4NX session: a device model of the same weights with the 4-bit ones
dequantized (a weight a GGUF kept in bf16 as it is), the numbers the Q4NX kernels multiply. The
end-to-end Q4NX tests hold a session to it, as `make verify QUANT=q4nx` holds it to HF."""
from __future__ import annotations

from dataclasses import replace

import torch

from llama_base import q4nx
from llama_runtime.checkpoints.loader import load_weights
from llama_runtime.engine.device_model import DeviceModel
from llama_runtime.checkpoints.q4nx_weights import linear_names, lm_head_rows
from llama_runtime.checkpoints.weights import LayerWeights


def dequantized_model(session) -> DeviceModel:
    w = load_weights(session.resolved, "q4nx", lambda _: None)
    cfg, layers = w.config, []
    for lw, plain in zip(w.layers, w.backing.layers):
        fields = lw.by_name()
        for short in linear_names(cfg):
            if fields[short].dtype == torch.uint8:
                fields[short] = q4nx.dequantize(fields[short], *getattr(plain, short).shape)
        layers.append(LayerWeights(**fields))
    head = q4nx.dequantize(w.lm_head, lm_head_rows(cfg), cfg.hidden_size)[:cfg.vocab_size]
    bf16 = replace(w, layers=layers, lm_head=head, quant="bf16", checkpoint=None, backing=None)
    return DeviceModel(session.kc, bf16, session.model.max_context, buckets=session.model.buckets)
