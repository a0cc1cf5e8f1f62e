"""Native host kernels that make the simulated NPU fast where torch is slow: the bf16 GEMV.

Built with the system C++ compiler on first use into the cache (keyed by the source hash),
loaded with ctypes, and used only when the CPU has AVX512-BF16; otherwise `gemv` is None and
the simulator uses torch. ctypes releases the GIL during the call, so splitting the rows over
a small thread pool uses every core without an OpenMP runtime of our own (torch brings one,
and two in one process fight over the cores).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from llama_runtime.paths import cache_root

_SRC = Path(__file__).resolve().parent / "native" / "gemv_bf16_cpu.cc"
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512bf16"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None
# Below this many weight bytes a second thread costs more than it saves.
_SPLIT_BYTES = 1 << 20


def _build() -> ctypes.CDLL | None:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return None
    digest = hashlib.sha256(_SRC.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out = cache_root() / "native" / f"gemv_bf16_cpu-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run([cxx, *_FLAGS, str(_SRC), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0:
            return None
        os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    if not lib.gemv_bf16_cpu_supported():
        return None
    lib.gemv_bf16_cpu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.gemv_bf16_cpu.restype = None
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _tried, _pool
    if not _tried:
        with _lock:
            if not _tried:
                if os.environ.get("LLAMA_NPU_NATIVE", "1") != "0":
                    try:
                        _lib = _build()
                    except OSError:
                        _lib = None
                threads = torch.get_num_threads()
                _pool = ThreadPoolExecutor(threads - 1) if _lib is not None and threads > 1 else None
                _tried = True
    return _lib


def available() -> bool:
    return _library() is not None


def gemv(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> bool:
    """out = w @ x (bf16, f32 accumulation) natively; False when the native path is unavailable."""
    lib = _library()
    if lib is None or not (w.is_contiguous() and x.is_contiguous() and out.is_contiguous()):
        return False
    m, k = w.shape
    wp, xp, yp = w.data_ptr(), x.data_ptr(), out.data_ptr()
    if _pool is None or w.numel() * 2 < _SPLIT_BYTES:
        lib.gemv_bf16_cpu(wp, xp, yp, k, 0, m)
        return True
    parts = _pool._max_workers + 1
    step = -(-m // parts)
    futures = [_pool.submit(lib.gemv_bf16_cpu, wp, xp, yp, k, i * step, min(m, (i + 1) * step))
               for i in range(1, parts)]
    lib.gemv_bf16_cpu(wp, xp, yp, k, 0, min(m, step))
    for f in futures:
        f.result()
    return True
