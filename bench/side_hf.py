"""Child process: HF transformers' Llama in bf16 on the CPU, with its KV cache (`DynamicCache`).

The verification's `HFRunner` already is the reference setup (local files only, bf16, one
logits row per forward); the bench times it as it is.
"""
from __future__ import annotations

from bench.protocol import child_main


def make_runner(job: dict):
    import torch
    import transformers

    from verify.hf_runner import HFRunner

    runner = HFRunner(job["folder"])
    info = {"transformers": transformers.__version__, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "attention": runner.model.config._attn_implementation}
    return runner, info


if __name__ == "__main__":
    raise SystemExit(child_main(make_runner))
