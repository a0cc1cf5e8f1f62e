"""The model on a device: per-layer buffer sets, the KV cache, prefill and decode steps, and the
recorded decode. Tokens in, logits out; no text, no sampling, no HTTP."""
