"""Host-side support for the Llama-3.2-1B NPU runtime: caches, tokenizer, offline models, host math."""
