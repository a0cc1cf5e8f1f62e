"""Where the runtime keeps what it builds.

Everything the runtime writes lives under one root so that `make clean` and a user's
disk-usage audit only have to look in one place, and so tests can point the whole
runtime at a temporary folder with one environment variable. Each folder under the root
is declared here, once (`CACHE_FOLDERS`); code asks `cache_dir(name)` (or one of the
functions below) for it and never composes one from the root by hand, and a test holds the
code, and the README's list, to this table. Two things are written
elsewhere: reports (`reports_dir`, a working-directory folder meant to be read and kept) and
Llama checkpoints downloaded from the Hugging Face hub, which stay in huggingface_hub's own
cache (`$HF_HOME`, default `~/.cache/huggingface`) so that other tools share one download.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "LLAMA_NPU_CACHE"
ENV_REPORTS = "LLAMA_NPU_REPORTS"

# Every folder under `cache_root()`, with what it holds (the README lists the same table).
CACHE_FOLDERS = {
    "models": "imported and generated checkpoints (the embedded model, GGUF files given as MODEL, the llama*-shape models, the tinies) and Q4NX weights",
    "kernels": "KernelCache entries, one folder per target kind (stitched MLIR, launch programs, ELFs)",
    "native": "the native CPU library, one build per ISA class and source digest (the least recently used removed beyond a few), "
              "and which of two rival classes this CPU ran faster",
    "host_kernels": "host builds of the NPU C++ kernels, which the MLIR-AIR interpreter calls",
    "kernel_objects": "Peano builds of the NPU C++ kernels (.o), shared by every ELF; only where Peano exists",
    "bench": "make bench: llama.cpp's build venv and the GGUF files converted for it",
    "cost": "the cost model's counts of stitched modules, per declaration and source version",
}


def cache_root() -> Path:
    """The root of every cache; `$LLAMA_NPU_CACHE` or ~/.cache/llama32-1b-npu."""
    env = os.environ.get(ENV_CACHE)
    root = Path(env) if env else Path.home() / ".cache" / "llama32-1b-npu"
    return root.expanduser()


def cache_dir(name: str) -> Path:
    """The folder `name` of `CACHE_FOLDERS` under the cache root; an undeclared name is a bug."""
    if name not in CACHE_FOLDERS:
        raise KeyError(f"{name!r} is not a declared cache folder ({', '.join(CACHE_FOLDERS)})")
    return cache_root() / name


def models_dir() -> Path:
    return cache_dir("models")


def kernels_dir() -> Path:
    return cache_dir("kernels")


def native_dir() -> Path:
    return cache_dir("native")


def host_kernels_dir() -> Path:
    return cache_dir("host_kernels")


def kernel_objects_dir() -> Path:
    return cache_dir("kernel_objects")


def bench_dir() -> Path:
    return cache_dir("bench")


def reports_dir() -> Path:
    """Verification and benchmark reports; `$LLAMA_NPU_REPORTS` or ./reports."""
    env = os.environ.get(ENV_REPORTS)
    return Path(env) if env else Path.cwd() / "reports"
