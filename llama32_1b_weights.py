"""Checkpoint folder → `LlamaWeights`.

The entry point the layout names; the code is `llama_runtime.checkpoints.loader`.
"""
from llama_runtime.checkpoints.loader import load_weights

__all__ = ["load_weights"]
