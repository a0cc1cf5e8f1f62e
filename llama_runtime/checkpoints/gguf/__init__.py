"""GGUF files: reading one without its vocabulary, its values in bf16, and its import into a
safetensors folder."""
