"""Seeded inputs of the kernel tests, the same in every run: the tests compare bits, so their
inputs come from a seed of their own, never from the global generator another test moved."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

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


@contextlib.contextmanager
def team(threads: int):
    """Parallel regions started from this thread get `threads` threads: the native library
    binds to the libgomp already loaded (torch's), which this handle reaches by its soname."""
    gomp = ctypes.CDLL(ctypes.util.find_library("gomp") or "libgomp.so.1")
    saved = gomp.omp_get_max_threads()
    gomp.omp_set_num_threads(threads)
    try:
        assert gomp.omp_get_max_threads() == threads
        yield
    finally:
        gomp.omp_set_num_threads(saved)
