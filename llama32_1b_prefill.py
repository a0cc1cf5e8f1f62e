"""Prefill: a prompt through every layer's device groups, then its last token's logits.

The entry point the layout names; the code is `llama_runtime.engine.prefill`.
"""
from llama_runtime.engine.prefill import prefill, prefill_chunk, prefill_layer, qkv_to_cache

__all__ = ["prefill", "prefill_chunk", "prefill_layer", "qkv_to_cache"]
