"""Seeded inputs of the kernel tests, the same in every run: the tests compare bits, so their
inputs come from a seed of their own, never from the global generator another test moved."""
from __future__ import annotations

import torch

from cpu_kernels import native_cpu
from cpu_kernels.weight_tiles import Q4nxPacking
from llama_runtime.checkpoints import quantize


def rand_bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values times `scale`, rounded to bf16."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def gemv_jobs(fmt: str, shapes: list[tuple[int, int]], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight in decode's device form, activation) for each [n, k] of `shapes`: Q4NX blocks
    (fmt "q4nx") or the packed bf16 tiles (fmt "bf16")."""
    empty = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)
    jobs = []
    for i, (n, k) in enumerate(shapes):
        w, x = rand_bf16(n, k, seed=seed + i, scale=0.02), rand_bf16(k, seed=seed + 100 + i, scale=0.02)
        dev = Q4nxPacking(n, k).pack(quantize.quantize(w), empty) if fmt == "q4nx" else native_cpu.pack_weight(w, empty)
        jobs.append((dev, x))
    return jobs


def run_gemvs(fmt: str, jobs, rows: list[int]) -> list[torch.Tensor]:
    """The outputs of `jobs` run as one native batch, every row NaN before the call."""
    ys = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in rows]
    batch = native_cpu.gemv_q4nx_batch_call if fmt == "q4nx" else native_cpu.gemv_batch_call
    batch([(w, x, y) for (w, x), y in zip(jobs, ys)])()
    return ys
