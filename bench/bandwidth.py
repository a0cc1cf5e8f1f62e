"""The machine's memory bandwidth: an f32 matrix-vector product over at least 1 GiB, all cores.

A GEMV reads its matrix exactly once, like a decode step reads its weights, so its rate is the
bandwidth a memory-bound decode can hope for. The matrix is far larger than the last-level
cache (some of these VMs report hundreds of MiB of it, which makes small benchmarks read from
cache).
The native AVX-512 kernel is used where the CPU has AVX-512, because library GEMVs fall short
of the hardware's streaming rate here; otherwise numpy's BLAS GEMV is used, and the report
says which method produced the number.

A sample's rate is the fastest of several passes, not their median: this is the ceiling a
decode is held against, and anything else running on the host can only slow a pass down. On a
VM the ceiling itself moves (other guests share the memory system), so the bench samples
again after every runtime and bounds decode by the median sample, reporting the range; each
pass's time is kept in the report. In the decode turns a child of this module
(`serve_samples`) samples it in every turn too, so that each burst has a bound of its own turn.
"""
from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.machine import cpu_flags
from npu_runtime.sim.device import zeroed_buffer

GIB = 1 << 30
_SRC = Path(__file__).resolve().parent / "native" / "gemv_f32_stream.cc"
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f"]
_ROW_FLOATS = 1024           # 4 KiB rows: x stays in L1 while the matrix streams past it


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float        # of the fastest timed pass
    matrix_bytes: int
    method: str
    threads: int
    pass_s: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def _native_gemv():
    from cpu_kernels.native_build import build_shared

    if "avx512f" not in cpu_flags():
        return None
    path = build_shared(_SRC, _FLAGS)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.gemv_f32_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    return lib


class Stream:
    """The GEMV and its matrix, made once, so that passes can be timed again and again: the
    decode turns take a sample in every turn, seconds apart from the runtimes' bursts."""

    def __init__(self, matrix_bytes: int = GIB):
        row_bytes = _ROW_FLOATS * np.dtype(np.float32).itemsize
        rows = -(-matrix_bytes // row_bytes)
        # On huge pages, as the runtime's weight buffers are; written, so every page is resident.
        a = zeroed_buffer(rows * row_bytes).numpy().view(np.float32).reshape(rows, _ROW_FLOATS)
        a.fill(1.0)
        x = np.ones(_ROW_FLOATS, dtype=np.float32)
        # The passes close over the arrays, never over self: a cycle would keep the matrix until
        # the cyclic collector ran, a GiB per sample of a run.
        self.y = y = np.empty(rows, dtype=np.float32)
        self.matrix_bytes = a.nbytes
        lib = _native_gemv()
        if lib is not None:
            self.threads = lib.gemv_f32_stream_threads()
            self.method = f"native AVX-512 f32 GEMV ({_SRC.name}), OpenMP, {self.threads} threads"
            self._run = lambda: lib.gemv_f32_stream(a.ctypes.data, x.ctypes.data, y.ctypes.data, rows, _ROW_FLOATS)
        else:
            self.threads = 0
            self.method = "numpy f32 GEMV (BLAS sgemv), library threading"
            self._run = lambda: np.matmul(a, x, out=y)
        self._run()          # untimed: the first pass also warms the library and its threads

    def sample(self, passes: int) -> Bandwidth:
        """The fastest of `passes` timed passes."""
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            self._run()
            times.append(time.perf_counter() - t0)
        if not np.all(self.y == _ROW_FLOATS):   # every row of ones · ones sums to its length, exactly in f32
            raise RuntimeError("the bandwidth GEMV computed a wrong result")
        return Bandwidth(self.matrix_bytes / min(times), self.matrix_bytes, self.method, self.threads, times)


def measure_bandwidth(matrix_bytes: int = GIB, passes: int = 8) -> Bandwidth:
    """Read rate of an f32 GEMV over a matrix of at least `matrix_bytes`; one untimed pass first."""
    return Stream(matrix_bytes).sample(passes)


def summarize(samples: list[tuple[str, Bandwidth]]) -> dict:
    """Samples taken through a run (each labelled with what had just run) → the rate to bound by."""
    rates = [b.bytes_per_s for _, b in samples]
    first = samples[0][1]
    return {"bytes_per_s": statistics.median(rates), "min_bytes_per_s": min(rates), "max_bytes_per_s": max(rates),
            "method": first.method, "matrix_bytes": first.matrix_bytes, "threads": first.threads,
            "samples": [{"after": label, **b.to_dict()} for label, b in samples]}


def serve_samples(matrix_bytes: int, commands, replies) -> int:
    """The decode turns' bandwidth child (`bench.turns`): a line "n" in → the rate in bytes/s of
    the fastest of n passes out. Returns the samples served."""
    stream = Stream(matrix_bytes)
    served = 0
    for line in commands:
        replies.write(f"{stream.sample(int(line)).bytes_per_s!r}\n")
        replies.flush()
        served += 1
    return served


if __name__ == "__main__":       # python -m bench.bandwidth WORKDIR: a child of the decode turns
    import json
    import sys

    from bench.protocol import JOB_FILE, turn_pipes

    job = json.loads((Path(sys.argv[1]) / JOB_FILE).read_text())
    commands, replies = turn_pipes(job)
    with commands, replies:
        serve_samples(job["matrix_bytes"], commands, replies)
