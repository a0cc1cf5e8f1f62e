"""Native host kernels that make the simulated NPU fast where torch is slow: the bf16 GEMV.

Built with the system C++ compiler on first use into the cache (keyed by the source hash and
flags), loaded with ctypes, and used only when the CPU has AVX512-BF16; otherwise the
simulator uses torch. The library is parallel with OpenMP and binds to the runtime torch has
already loaded (torch is imported first), so both share one thread team and torch's
`set_num_threads` governs both. `LLAMA_NPU_NATIVE=0` turns the native path off.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from llama_runtime.paths import cache_root

_SRC = Path(__file__).resolve().parent / "native" / "gemv_bf16_cpu.cc"
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512bf16"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def build_shared(src: Path, flags: list[str]) -> Path | None:
    """`src` compiled into a shared library under the cache, or None without a working compiler.

    Keyed by the source and flags, so an edit rebuilds it, and renamed into place so that a
    concurrent process never loads a half-written file.
    """
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return None
    digest = hashlib.sha256(src.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_root() / "native" / f"{src.stem}-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run([cxx, *flags, str(src), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0:
            return None
        os.replace(tmp, out)
    return out


def _build() -> ctypes.CDLL | None:
    out = build_shared(_SRC, _FLAGS)
    if out is None:
        return None
    lib = ctypes.CDLL(str(out))
    if not lib.gemv_bf16_cpu_supported():
        return None
    lib.gemv_bf16_cpu_batch.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                if os.environ.get("LLAMA_NPU_NATIVE", "1") != "0":
                    try:
                        _lib = _build()
                    except OSError:
                        _lib = None
                _tried = True
    return _lib


def gemv_batch(jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> bool:
    """out = w @ x for each (w, x, out), natively in one dispatch; False if the native path is unavailable."""
    lib = _library()
    if lib is None or not all(w.is_contiguous() and x.is_contiguous() and y.is_contiguous() for w, x, y in jobs):
        return False
    desc = (ctypes.c_int64 * (5 * len(jobs)))()
    for i, (w, x, y) in enumerate(jobs):
        desc[5 * i:5 * i + 5] = [w.data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0], w.shape[1]]
    lib.gemv_bf16_cpu_batch(desc, len(jobs))
    return True


def gemv(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> bool:
    return gemv_batch([(w, x, out)])
