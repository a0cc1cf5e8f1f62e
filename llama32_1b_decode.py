"""Decode: one token through every layer's device groups plus host attention.

The entry point the layout names; the code is `llama_runtime.engine.decode`.
"""
from llama_runtime.engine.decode import attend_and_ffn, decode_layer, decode_step

__all__ = ["attend_and_ffn", "decode_layer", "decode_step"]
