"""Checkpoints: which one a run uses, reading and writing safetensors folders, the built-in
models, GGUF imports and Q4NX weights. Nothing here knows a device."""
