"""The weight formats a model runs in, and so a group can be declared with.

Below the builders and the runtime alike: the command lines offer these, the checkpoints make
them and the groups declare slots in them, so the list lives where all of them can read it.
"""
from __future__ import annotations

from llama_base import q4nx

# Weight formats a group can be declared with: "bf16", or a quantized format whose slots hold a
# matrix of the declared (logical) shape as bytes laid out by its declaration (`llama_base.q4nx`).
QUANTS = ("bf16", q4nx.NAME)
