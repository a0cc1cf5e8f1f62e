"""Perplexity arithmetic every runtime's scores go through: the same sums for ours, HF and llama.cpp.

A scorer is anything with `score(ids) -> (nll, top1)`: for each position i < len(ids) - 1, the
negative log-likelihood (natural log) of ids[i + 1] given ids[: i + 1], and the token the model
ranks first there. Chunks are scored independently (a fresh sequence each, starting at its
BOS), so every runtime sees exactly the same contexts whatever its context length or batching.

Standard library only: the llama.cpp side imports this under the interpreter of its own build,
which has nothing but llama-cpp-python and numpy.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def score_chunks(scorer, chunks: Sequence[Sequence[int]]) -> dict:
    """Every chunk scored: {"nll": [...], "top1": [...]} over all chunks' predicted positions, in order."""
    nll: list[float] = []
    top1: list[int] = []
    for ids in chunks:
        if len(ids) < 2:
            raise ValueError("a chunk needs a context token and at least one token to predict")
        n, t = scorer.score(list(ids))
        if len(n) != len(ids) - 1 or len(t) != len(ids) - 1:
            raise ValueError(f"a scorer returned {len(n)} / {len(t)} scores for {len(ids) - 1} predicted tokens")
        nll += [float(x) for x in n]
        top1 += [int(x) for x in t]
    return {"nll": nll, "top1": top1}


def perplexity(nll: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood per predicted token."""
    if not nll:
        raise ValueError("no scored tokens")
    return math.exp(math.fsum(nll) / len(nll))


def agreement(top1: Sequence[int], reference: Sequence[int]) -> float:
    """The fraction of positions where two runtimes rank the same token first."""
    if len(top1) != len(reference) or not top1:
        raise ValueError(f"top-1 lists of {len(top1)} and {len(reference)} positions cannot be compared")
    return sum(a == b for a, b in zip(top1, reference)) / len(top1)

