"""Run time, model side, in rooms that build on one another (bottom to top):

- `text/`: tokenizer and chat formats;
- `checkpoints/`: resolution, safetensors, built-in models, GGUF, Q4NX weights;
- `engine/`: the model on a device (buffer sets, KV cache, prefill, decode, the recorded token);
- `generation/`: `Session`, sampling, logprobs, grammars, conversations;
- `serve/`: the OpenAI-compatible server;
- `cli/`: the command lines.

A room imports only from rooms below it (`tests/test_layering.py`)."""
