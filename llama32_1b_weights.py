"""Checkpoint folder → `LlamaWeights`.

The entry point the layout names; the code is `llama_runtime.checkpoint`.
"""
from llama_runtime.checkpoint import load_weights

__all__ = ["load_weights"]
