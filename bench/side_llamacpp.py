"""Child process: llama.cpp through llama-cpp-python, under the interpreter of its own build.

Greedy tokens are read straight from the last row of llama.cpp's logits, so no sampler chain
runs; threads are set to every core for both prompt and generation (the library's default
uses half the cores for generation).
"""
from __future__ import annotations

import os

from bench.protocol import child_main


class _Token:
    def __init__(self, top1: int):
        self.top1 = top1


class LlamaCppRunner:
    def __init__(self, gguf: str, n_ctx: int):
        import llama_cpp

        threads = os.cpu_count() or 1
        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self.threads = threads

    def _top1(self) -> _Token:
        import numpy as np

        logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        return _Token(int(logits.argmax()))

    def prefill(self, tokens: list[int]) -> _Token:
        self.llm.reset()
        self.llm.eval(tokens)
        return self._top1()

    def decode_step(self, token: int, pos: int) -> _Token:
        if pos != self.llm.n_tokens:
            raise ValueError(f"decode at position {pos}, but {self.llm.n_tokens} positions are cached")
        self.llm.eval([token])
        return self._top1()


def make_runner(job: dict):
    import llama_cpp

    runner = LlamaCppRunner(job["gguf"], job["max_context"])
    info = {"llama_cpp_python": llama_cpp.__version__, "threads": runner.threads, "n_ctx": runner.llm.n_ctx(),
            "n_batch": runner.llm.n_batch, "gguf": job["gguf"],
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    return runner, info


if __name__ == "__main__":
    raise SystemExit(child_main(make_runner))
