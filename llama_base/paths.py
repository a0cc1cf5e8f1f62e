"""Where the runtime keeps what it builds.

Everything the runtime writes lives under one root so that `make clean` and a user's
disk-usage audit only have to look in one place, and so tests can point the whole
runtime at a temporary folder with one environment variable.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "LLAMA_NPU_CACHE"


def cache_root() -> Path:
    """The root of every cache (models, kernels); `$LLAMA_NPU_CACHE` or ~/.cache/llama32-1b-npu."""
    env = os.environ.get(ENV_CACHE)
    root = Path(env) if env else Path.home() / ".cache" / "llama32-1b-npu"
    return root.expanduser()


def models_dir() -> Path:
    """Imported and generated checkpoints (the embedded default model, the 1B-shape test model)."""
    return cache_root() / "models"


def kernels_dir() -> Path:
    """KernelCache artifacts: stitched MLIR, launch programs, ELFs where a toolchain exists."""
    return cache_root() / "kernels"


def reports_dir() -> Path:
    """Verification and benchmark reports; `$LLAMA_NPU_REPORTS` or ./reports."""
    env = os.environ.get("LLAMA_NPU_REPORTS")
    return Path(env) if env else Path.cwd() / "reports"
