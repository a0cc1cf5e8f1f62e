"""Generation in tokens: prefill a prompt, then decode, yielding each chosen token with the
logits it was chosen from.

Nothing here knows about text. What the answer reads like (detokenizing, stop strings), how
likely its tokens were (log probabilities) and how long it took are the business of the layer
above (`Session.generate`), which reads a `TokenStream` and may stop reading it at any token.
Whatever ends an answer, the KV cache records which tokens it holds (`KVCache.token_ids`), so
the next prompt can reuse the longest prefix of them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from llama_base.errors import PromptError
from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.device_model import DeviceModel
from llama_runtime.engine.prefill import prefill
from llama_runtime.generation.processors import LogitsProcessors
from llama_runtime.generation.sampling import Sampler
from npu_runtime.profiler import NULL_PROFILER, Profiler


@dataclass(frozen=True)
class Step:
    token: int
    logits: torch.Tensor    # float32, after the processors: what `token` was chosen from


def reusable_prefix(cached: Sequence[int], ids: Sequence[int]) -> int:
    """Length of the cached prefix `ids` can keep. The last prompt token is always prefilled:
    its logits are what the first answer token is chosen from."""
    n, limit = 0, min(len(cached), len(ids) - 1)
    while n < limit and cached[n] == ids[n]:
        n += 1
    return n


class TokenStream:
    """One answer's tokens, generated as they are iterated (once).

    Iteration ends by itself at an end token (not yielded), after `n_tokens`, at the context
    limit, on Ctrl-C, or when `should_stop` (asked once per token, before the next decode step)
    returns True; `stop_reason` then says which: end_token | n_tokens | context_limit |
    interrupted | cancelled. A reader that stops early leaves it None and names its own reason.
    The last yielded token is fed back only if another is asked for, so `cached` (positions
    whose K/V are now in the cache) always counts what the cache really holds.
    """

    def __init__(self, model: DeviceModel, ids: Sequence[int], n_tokens: int, processors: LogitsProcessors,
                 sampler: Sampler, end_ids: frozenset[int], should_stop: Callable[[], bool] | None = None,
                 reuse_cache: bool = True, profiler: Profiler = NULL_PROFILER):
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
            raise PromptError(f"the number of tokens to generate must be a positive integer (got {n_tokens!r})")
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) >= model.max_context:
            raise PromptError(f"the prompt needs {len(ids)} positions and leaves no room to generate: "
                              f"the context limit is {model.max_context} (raise it with --max-context)")
        self.model, self.ids, self.n_tokens = model, list(ids), n_tokens
        self.processors, self.sampler, self.end_ids = processors, sampler, end_ids
        self.should_stop, self.profiler = should_stop, profiler
        self.start = reusable_prefix(model.kv.token_ids, self.ids) if reuse_cache else 0
        self.cached = self.start
        self.tokens: list[int] = []
        self.stop_reason: str | None = None
        self._started = False

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens this answer prefills: those past the prefix reused from the cache."""
        return len(self.ids) - self.start

    def __iter__(self) -> Iterator[Step]:
        if self._started:
            raise RuntimeError("a token stream is generated once")
        self._started = True
        return self._generate()

    def _generate(self) -> Iterator[Step]:
        ids, out, limit = self.ids, self.tokens, self.model.max_context
        try:
            logits = prefill(self.model, ids[self.start :], start=self.start)
            self.cached = len(ids)
            while True:
                with self.profiler.host_op("sampling"):
                    shaped = self.processors(logits, ids + out)
                    tok = self.sampler(shaped)
                if tok in self.end_ids:
                    self.stop_reason = "end_token"
                    return
                out.append(tok)
                yield Step(tok, shaped)
                if len(out) >= self.n_tokens:
                    self.stop_reason = "n_tokens"
                    return
                if self.cached >= limit:
                    self.stop_reason = "context_limit"
                    return
                if self.should_stop is not None and self.should_stop():
                    self.stop_reason = "cancelled"
                    return
                logits = decode_step(self.model, tok, self.cached)
                self.cached += 1
        except KeyboardInterrupt:
            self.stop_reason = "interrupted"


def read_prompt(model: DeviceModel, ids: Sequence[int], processors: LogitsProcessors) -> Iterator[torch.Tensor]:
    """The logits each of `ids[1:]` was read with, given the ones before it, shaped by
    `processors` as a generated token's are.

    Prefill keeps only its last row's logits, so the prompt goes through decode steps one
    token at a time (slower than a prefill). All but its last token end up in the cache.
    """
    for i, t in enumerate(ids[:-1]):
        yield processors(decode_step(model, t, i), ids[: i + 1])
