"""Host builds of the kernels' portable scalar paths, called through ctypes.

Each kernel source keeps a plain C++ path next to its AIE API path; compiled by the host
compiler with the same `-D` defines as the Peano object, it performs the kernel's
arithmetic and indexing on the CPU, so tests check a kernel's math against numpy without
an NPU. Arguments are validated against the kernel's MLIR types from `externs.py`, so a
host call that passes, say, a K=2048 vector to the K=8192 GEMV fails loudly instead of
reading past the buffer.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, Iterable

import ml_dtypes
import numpy as np
from filelock import FileLock

from kernel_builder.external_kernels import KERNELS_DIR, Toolchain, stamp
from kernel_builder.externs import ExternKernel

ENV_CXX = "CXX"
# -ffp-contract=off keeps `a * b + c` two roundings even where the host has FMA, so the
# scalar path computes exactly what its source says. -Werror keeps that path warning-free.
HOST_FLAGS = ("-O2", "-std=c++20", "-fPIC", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror")

# MLIR element type -> (C++ parameter type in the kernel sources, numpy dtypes accepted).
ELEMENT_TYPES: dict[str, tuple[str, tuple[np.dtype, ...]]] = {
    "bf16": ("bf16", (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16))),
    "f32": ("float", (np.dtype(np.float32),)),
    "i32": ("int32_t", (np.dtype(np.int32),)),
    "i8": ("uint8_t", (np.dtype(np.uint8), np.dtype(np.int8))),     # bytes: a Q4NX matrix
}

_MEMREF = re.compile(r"memref<((?:\d+x)+)(\w+)(?:,[^>]*)?>")


@dataclass(frozen=True)
class ArgType:
    """One kernel argument: a buffer (`shape` set) or a scalar (`shape` None)."""

    dtype: str
    shape: tuple[int, ...] | None

    @classmethod
    def parse(cls, mlir_type: str) -> "ArgType":
        m = _MEMREF.fullmatch(mlir_type.strip())
        if m:
            return cls(m.group(2), tuple(int(d) for d in m.group(1).rstrip("x").split("x")))
        if mlir_type in ELEMENT_TYPES:
            return cls(mlir_type, None)
        raise ValueError(f"unsupported kernel argument type {mlir_type!r}")


def host_toolchain() -> Toolchain:
    return Toolchain(Path(os.environ.get(ENV_CXX, "g++")), HOST_FLAGS)


def build_host_library(kernels: Iterable[ExternKernel], out_dir: Path, toolchain: Toolchain | None = None) -> Path:
    """A shared library of the kernels' scalar paths, reused while every kernel's stamp holds.

    Every kernel is its own translation unit with its own defines, as on the device; the
    library's name is a hash of their stamps, so an existing file is always current.
    """
    kernels = list(kernels)
    tc = toolchain or host_toolchain()
    digest = hashlib.sha256("".join(sorted(stamp(k, tc) for k in kernels)).encode()).hexdigest()[:20]
    out_dir = Path(out_dir)
    lib = out_dir / f"kernels_{digest}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir / ".host-build.lock")):
        if lib.is_file():
            return lib
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            objs = []
            for k in kernels:
                obj = Path(tmp) / k.obj
                _run(tc.compile_command(k, KERNELS_DIR / k.source, obj), k.symbol)
                objs.append(str(obj))
            part = Path(tmp) / lib.name
            _run([str(tc.cxx), "-shared", *objs, "-o", str(part)], lib.name)
            os.replace(part, lib)
    return lib


def _run(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"host build of {what} failed ({' '.join(cmd)}):\n{res.stderr}")


class HostKernels:
    """The scalar paths of `kernels`, callable by symbol: `hk(symbol, *numpy_arrays_or_ints)`."""

    def __init__(self, kernels: Iterable[ExternKernel], out_dir: Path, toolchain: Toolchain | None = None):
        kernels = list(kernels)
        self.library = build_host_library(kernels, out_dir, toolchain)
        lib = ctypes.CDLL(str(self.library))
        self._fns: dict[str, tuple[Any, tuple[ArgType, ...]]] = {}
        for k in kernels:
            types = tuple(ArgType.parse(t) for t in k.arg_types)
            fn = getattr(lib, k.symbol)
            fn.argtypes = [ctypes.c_void_p if t.shape is not None else ctypes.c_int32 for t in types]
            fn.restype = None
            self._fns[k.symbol] = (fn, types)

    def __call__(self, symbol: str, *args) -> None:
        fn, types = self._fns[symbol]
        if len(args) != len(types):
            raise TypeError(f"{symbol} takes {len(types)} arguments, got {len(args)}")
        return fn(*(_convert(symbol, i, t, a) for i, (t, a) in enumerate(zip(types, args))))


def _convert(symbol: str, index: int, t: ArgType, value):
    where = f"{symbol} argument {index}"
    if t.shape is None:
        if not isinstance(value, (int, np.integer)):
            raise TypeError(f"{where}: expected an {t.dtype} scalar, got {type(value).__name__}")
        return int(value)
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{where}: expected a numpy array, got {type(value).__name__}")
    accepted = ELEMENT_TYPES[t.dtype][1]
    if value.dtype not in accepted:
        raise TypeError(f"{where}: dtype {value.dtype} is not one of {[str(d) for d in accepted]}")
    if value.size != prod(t.shape) or not value.flags.c_contiguous:
        raise ValueError(f"{where}: needs a contiguous buffer of shape {t.shape}, got {value.shape}")
    return value.ctypes.data
