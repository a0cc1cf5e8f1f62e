"""Logits processors: what turns the model's logits into the ones a token is chosen from.

Each is a small object called as `(logits, history) -> logits`, `history` being every token of
the context so far (the prompt, then the answer). `LogitsProcessors` runs them in order, and
`processors_for` fixes that order for a request: the repetition penalty first, on the model's
own logits (a bias must not flip which way it scales a token); then `logit_bias`; then a
grammar's mask last, so that no bias can bring back a token the grammar forbids (+inf added
to a masked -inf would be NaN, and greedy choice picks a NaN). The sampler picks from the
result, and log probabilities reported to clients are read from it too (logprobs.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from llama_runtime.generation.sampling import SamplingParams


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor: ...


class RepetitionPenalty:
    """The CTRL rule: positive logits of tokens already in the context shrink, negative ones grow."""

    def __init__(self, penalty: float):
        self.penalty = penalty

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        if not history:
            return logits
        idx = torch.tensor(sorted(set(history)), dtype=torch.long)
        seen = logits[idx]
        logits = logits.clone()
        logits[idx] = torch.where(seen > 0, seen / self.penalty, seen * self.penalty)
        return logits


class LogitBias:
    """A fixed amount added to some tokens' logits; ids are checked against the vocabulary by
    whoever took them from a user."""

    def __init__(self, bias: Sequence[tuple[int, float]]):
        self.ids = torch.tensor([i for i, _ in bias], dtype=torch.long)
        self.values = torch.tensor([b for _, b in bias], dtype=torch.float32)

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        return logits.index_add(0, self.ids, self.values.to(logits.dtype))


class GrammarMask:
    """Forbids (-inf) every token `constraint` (constrained.Constraint) does not allow next.

    The grammar must hear each chosen token before it can say what may follow; it learns them
    from `history`: every token added since the previous call is consumed first, so the mask
    needs no other hook into the loop that chooses.
    """

    def __init__(self, constraint):
        self.constraint = constraint
        self._seen: int | None = None       # history's length at the previous call

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        if self._seen is not None:
            for token in history[self._seen :]:
                self.constraint.consume(token)
        self._seen = len(history)
        return logits.masked_fill(~self.constraint.allowed(), float("-inf"))


class LogitsProcessors:
    """Processors composed in the order given; the result is float32 whatever the model's logits."""

    def __init__(self, *processors: LogitsProcessor):
        self.processors = processors

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        logits = logits.float()
        for p in self.processors:
            logits = p(logits, history)
        return logits


def processors_for(params: SamplingParams, constraint=None) -> LogitsProcessors:
    """The processors a request asks for, in the one order they compose in (see above); the
    ones it leaves at their neutral setting are left out."""
    chain: list[LogitsProcessor] = []
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(params.repetition_penalty))
    if params.logit_bias:
        chain.append(LogitBias(params.logit_bias))
    if constraint is not None:
        chain.append(GrammarMask(constraint))
    return LogitsProcessors(*chain)
