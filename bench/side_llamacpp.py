"""Child process: llama.cpp through llama-cpp-python, under the interpreter of its own build.

Greedy tokens are read straight from the last row of llama.cpp's logits, so no sampler chain
runs; threads are set to every core for both prompt and generation (the library's default
uses half the cores for generation).
"""
from __future__ import annotations

import os

from bench.protocol import PERPLEXITY, child_main


class _Token:
    def __init__(self, top1: int):
        self.top1 = top1


class LlamaCppRunner:
    def __init__(self, gguf: str, n_ctx: int, logits_all: bool = False):
        """`logits_all` keeps every position's logits (for `score`); timed runs leave it off, as
        llama.cpp's own generation does, since it costs a copy of the logits per position."""
        import llama_cpp

        threads = os.cpu_count() or 1
        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   logits_all=logits_all, verbose=False)
        self.threads = threads

    def _top1(self) -> _Token:
        import numpy as np

        logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        return _Token(int(logits.argmax()))

    def prefill(self, tokens: list[int]) -> _Token:
        self.llm.reset()
        self.llm.eval(tokens)
        return self._top1()

    def score(self, ids: list[int]) -> tuple[list[float], list[int]]:
        """`verify.scoring`'s scorer: the chunk evaluated in llama.cpp's batches, every row's logits read."""
        import numpy as np

        self.llm.reset()
        self.llm.eval(ids)
        logits = np.asarray(self.llm.scores[:len(ids) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        nll = log_z - logits[np.arange(len(ids) - 1), ids[1:]]
        return nll.tolist(), logits.argmax(axis=1).tolist()

    def decode_step(self, token: int, pos: int) -> _Token:
        if pos != self.llm.n_tokens:
            raise ValueError(f"decode at position {pos}, but {self.llm.n_tokens} positions are cached")
        self.llm.eval([token])
        return self._top1()


def make_runner(job: dict):
    import llama_cpp

    runner = LlamaCppRunner(job["gguf"], job["max_context"], logits_all=PERPLEXITY in job)
    info = {"llama_cpp_python": llama_cpp.__version__, "threads": runner.threads, "n_ctx": runner.llm.n_ctx(),
            "n_batch": runner.llm.n_batch, "gguf": job["gguf"],
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    return runner, info


if __name__ == "__main__":
    raise SystemExit(child_main(make_runner))
