"""Comparators: the top-k gate on teacher-forced logits, and hidden-state distances.

Why a top-k gate rather than exact token equality: bf16 runs that accumulate in a different
order legitimately flip near-ties (a 0.1-logit gap is within bf16 noise), so demanding equal
tokens would fail correct implementations. A real bug (wrong RoPE convention, a dropped
residual, a misplaced head) moves the choice far down the other side's ranking. So at every
step where the top-1 tokens differ, each side's choice must be among the other side's top k.

Ranks count strictly larger logits, so a token tied with the leader has rank 1: bf16 logits
tie often, and a tie is not a disagreement.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

TOP_K = 5


def rank_of(logits: torch.Tensor, token: int) -> int:
    """1-based rank of `token` in `logits`: one more than the number of strictly larger logits."""
    return int((logits > logits[token]).sum()) + 1


@dataclass(frozen=True)
class Divergence:
    step: int
    hf_token: int
    our_token: int
    hf_token_rank_in_ours: int
    our_token_rank_in_hf: int
    ok: bool


@dataclass
class PromptGate:
    steps: int
    agreements: int
    divergences: list[Divergence]

    @property
    def passed(self) -> bool:
        return all(d.ok for d in self.divergences)

    @property
    def first_divergence(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    def to_json(self) -> dict:
        return {"steps": self.steps, "agreements": self.agreements, "passed": self.passed,
                "divergences": [asdict(d) for d in self.divergences]}


def gate_prompt(hf_logits: torch.Tensor, our_logits: torch.Tensor, k: int = TOP_K) -> PromptGate:
    """Check every step of one prompt's teacher-forced logits ([steps, vocab] each)."""
    if hf_logits.shape != our_logits.shape:
        raise ValueError(f"trace shapes differ: HF {tuple(hf_logits.shape)} vs ours {tuple(our_logits.shape)}")
    divergences = []
    for step, (ref, ours) in enumerate(zip(hf_logits, our_logits)):
        a, b = int(ref.argmax()), int(ours.argmax())
        if a == b:
            continue
        ra, rb = rank_of(ours, a), rank_of(ref, b)
        divergences.append(Divergence(step, a, b, ra, rb, ra <= k and rb <= k))
    steps = hf_logits.shape[0]
    return PromptGate(steps, steps - len(divergences), divergences)


@dataclass(frozen=True)
class HiddenDiff:
    cosine: float            # over the whole tensor
    worst_row_cosine: float  # the least similar row (token); equals `cosine` for a single row
    max_abs: float           # largest elementwise |ours - reference|
    ref_max_abs: float       # the reference's own largest magnitude, for scale


def hidden_diff(ours: torch.Tensor, ref: torch.Tensor) -> HiddenDiff:
    """Distances in f64: trained models carry a few activations near 1e4 on some rows, where f32
    sums of squares already lose the digits a cosine near 1 is read from.

    The per-row minimum matters because those same outliers dominate the whole-tensor cosine,
    and some bugs spare whole rows (a RoPE error leaves position 0 untouched).
    """
    if ours.shape != ref.shape:
        raise ValueError(f"shapes differ: ours {tuple(ours.shape)} vs reference {tuple(ref.shape)}")
    a, b = ours.double(), ref.double()
    rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    return HiddenDiff(float(F.cosine_similarity(a.reshape(-1), b.reshape(-1), dim=0)),
                      float(F.cosine_similarity(rows_a, rows_b, dim=-1).min()),
                      float((a - b).abs().max()), float(b.abs().max()))
