"""What a side of a verification must provide, and the decoding loop both sides share.

Both the HF reference and our runtime are driven through the same two calls and the same
`run_trace` loop, so any difference in a trace comes from the models' numbers, never from
two loops that disagree about positions or stopping.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llama_runtime.generation.sampling import greedy


@dataclass
class StepResult:
    """Next-token logits (f32, the model's full vocabulary), owned by the caller."""

    logits: torch.Tensor

    @property
    def top1(self) -> int:
        return greedy(self.logits)


@dataclass
class PrefillResult(StepResult):
    """Logits at the last real prompt position, plus what the diagnosis compares.

    `layers[i]` is layer i's output hidden state for every prompt row ([n, hidden]);
    `final_normed` is the last row after the final RMSNorm. Both are empty unless asked for.
    """

    layers: list[torch.Tensor] = field(default_factory=list)
    final_normed: torch.Tensor | None = None


class Runner(Protocol):
    def prefill(self, tokens: Sequence[int], keep_layers: bool = False) -> PrefillResult:
        """Run the prompt from position 0 (discarding any previous sequence)."""

    def decode_step(self, token: int, pos: int) -> StepResult:
        """Feed `token` at position `pos`, which must equal the number of tokens already cached."""


@dataclass
class Trace:
    """One prompt's decoding: the token fed after each step and the logits that step produced."""

    tokens: list[int]
    logits: torch.Tensor      # [steps, vocab] f32; row i predicts tokens[i]


def run_trace(runner: Runner, prompt: Sequence[int], n_tokens: int, end_ids: Collection[int],
              forced: Sequence[int] | None = None) -> Trace:
    """Greedy decoding of up to `n_tokens` tokens, or teacher forcing when `forced` is given.

    Greedy decoding stops after choosing an end token, as generation does. Teacher forcing
    feeds exactly `forced` (the other side's greedy tokens), so both sides see the same
    sequence and their logits are comparable step by step, however early they diverge.
    """
    steps = len(forced) if forced is not None else n_tokens
    if steps < 1:
        raise ValueError("a trace needs at least one step")
    rows, tokens = [], []
    result: StepResult = runner.prefill(prompt)
    pos = len(prompt)
    for step in range(steps):
        rows.append(result.logits)
        tok = int(forced[step]) if forced is not None else result.top1
        tokens.append(tok)
        if step + 1 == steps or (forced is None and tok in end_ids):
            break
        result = runner.decode_step(tok, pos)
        pos += 1
    return Trace(tokens, torch.stack(rows))
