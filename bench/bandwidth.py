"""The machine's memory bandwidth: an f32 matrix-vector product over at least 1 GiB, all cores.

A GEMV reads its matrix exactly once, like a decode step reads its weights, so its rate is the
bandwidth a memory-bound decode can hope for. The matrix is far larger than the last-level
cache (some of these VMs report hundreds of MiB of it, which makes small benchmarks read from
cache).
A native kernel (AVX-512, else AVX2 + FMA) is used, because library GEMVs fall short of the
hardware's streaming rate here; numpy's BLAS GEMV only where neither builds. The native pass
can also ask for its lines ahead (no hint, NTA, T1 or T0): which reads fastest depends on the
CPU (on an Intel Xeon, T1 read 9 % above the hardware prefetchers alone), so a stream times
each twice, alternated, and keeps the fastest for all its samples. The report says which
method and which way produced the number.

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
from functools import partial
from pathlib import Path

import numpy as np

from bench.machine import cpu_flags
from npu_runtime.sim.device import zeroed_buffer

GIB = 1 << 30
_SRC = Path(__file__).resolve().parent / "native" / "gemv_f32_stream.cc"
_COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp"]
_ROW_FLOATS = 1024           # 4 KiB rows: x stays in L1 while the matrix streams past it
NUMPY = "numpy f32 GEMV (BLAS sgemv), library threading"   # where no native pass builds
# The ways a native pass may read: (label, prefetch locality or -1 for none, bytes ahead). For T1
# and T0, 2 KiB read within 1 % of the best of 1-16 KiB on the Intel Xeon.
WAYS = (("no prefetch", -1, 0), ("prefetch NTA 2 KiB ahead", 0, 2048),
        ("prefetch T1 2 KiB ahead", 2, 2048), ("prefetch T0 2 KiB ahead", 3, 2048))


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float        # of the fastest timed pass
    matrix_bytes: int
    method: str
    threads: int
    pass_s: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


# The native pass's builds, widest first: the CPU flags each needs, and its compiler flags.
_ISAS = {"AVX-512": ({"avx512f"}, ["-mavx512f"]), "AVX2": ({"avx2", "fma"}, ["-mavx2", "-mfma"])}


def buildable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The builds of the native pass this CPU can run, widest first."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa, (needs, _) in _ISAS.items() if needs <= flags]


def native_isa(flags: frozenset[str] | None = None) -> str | None:
    """The widest build of the native pass this CPU can run, or None."""
    return next(iter(buildable_isas(flags)), None)


def _native_gemv(isa_flags: list[str]):
    from cpu_kernels.native_build import build_shared

    path = build_shared(_SRC, _COMMON_FLAGS + isa_flags)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.gemv_f32_stream.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                                             ctypes.c_int64]
    lib.gemv_f32_stream.restype = ctypes.c_int
    return lib


def ways_of(isa: str | None) -> list[str]:
    """The labels of the ways a stream chooses from where the native pass is built for `isa`."""
    return [f"native {isa} f32 GEMV, {label}" for label, _, _ in WAYS] if isa is not None else [NUMPY]


def _fastest(runs: dict[str, object], passes: int, clock=time.perf_counter) -> str:
    """The label of the run whose best of `passes` alternated passes is fastest (`clock` is
    the timer, so the choice can be tested without timing anything)."""
    best: dict[str, float] = {}
    for _ in range(passes):
        for label, run in runs.items():
            t0 = clock()
            run()
            best[label] = min(best.get(label, float("inf")), clock() - t0)
    return min(best, key=best.get)


class Stream:
    """The GEMV and its matrix, made once, so that passes can be timed again and again: the
    decode turns take a sample in every turn, seconds apart from the runtimes' bursts.

    `ways` limits the choice to those labels of `ways_of` (all by default); `isa` forces the
    native build's ISA ("AVX2" on an AVX-512 machine), or "none" for numpy's GEMV, to test the
    lower ones."""

    def __init__(self, matrix_bytes: int = GIB, ways: tuple[str, ...] | None = None, isa: str | None = None):
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
        native = native_isa() if isa is None else None if isa == "none" else isa
        lib = _native_gemv(_ISAS[native][1]) if native is not None else None
        # Each way is a cut pass, `run(starts, counts)`; the whole pass is one call over every row.
        runs = {}
        if lib is not None:
            def way(hint: int, ahead: int):
                def run(starts: np.ndarray, counts: np.ndarray):
                    if lib.gemv_f32_stream(a.ctypes.data, x.ctypes.data, y.ctypes.data, starts.ctypes.data,
                                           counts.ctypes.data, len(starts), _ROW_FLOATS, hint, ahead):
                        raise RuntimeError(f"the bandwidth GEMV does not know prefetch hint {hint}")
                return run

            for label, hint, ahead in WAYS:
                runs[f"native {native} f32 GEMV, {label}"] = way(hint, ahead)
        if not runs:
            # Not alternated with the native ways: OpenBLAS's threads spin on the cores after a
            # call and halve the rate of whatever runs next (docs/profile.md).
            def numpy_run(starts: np.ndarray, counts: np.ndarray):
                for r0, n in zip(starts.tolist(), counts.tolist()):
                    np.matmul(a[r0:r0 + n], x, out=y[r0:r0 + n])
            runs[NUMPY] = numpy_run
        every_row = (np.zeros(1, dtype=np.int64), np.array([rows], dtype=np.int64))
        runs = {label: partial(run, *every_row) for label, run in runs.items() if ways is None or label in ways}
        if not runs:
            raise ValueError(f"no bandwidth GEMV among {ways}; this machine has {list(ways_of(native))}")
        for run in runs.values():
            run()            # untimed: the first pass also warms the libraries and their threads
        self.way = _fastest(runs, 2) if len(runs) > 1 else next(iter(runs))
        if self.way == NUMPY:
            self.threads, self.method = 0, NUMPY
        else:
            self.threads = lib.gemv_f32_stream_threads()
            self.method = f"{self.way} ({_SRC.name}, OpenMP, {self.threads} threads; the fastest of {len(runs)} ways)"
        self._pass, self._every_row = runs[self.way].func, every_row     # the kept way's `run(starts, counts)`
        self._rows = rows

    def sample(self, passes: int) -> Bandwidth:
        """The fastest of `passes` timed passes."""
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            self._pass(*self._every_row)
            times.append(time.perf_counter() - t0)
        if not np.all(self.y == _ROW_FLOATS):   # every row of ones · ones sums to its length, exactly in f32
            raise RuntimeError("the bandwidth GEMV computed a wrong result")
        return Bandwidth(self.matrix_bytes / min(times), self.matrix_bytes, self.method, self.threads, times)

    def sample_calls(self, call_bytes: list[int], passes: int) -> dict:
        """The same way cut into calls of `call_bytes` (a decode step's GEMV dispatches,
        `bench.bound.decode_call_bytes`), alternated with whole passes: the fastest of `passes`
        each, and their ratio, the ceiling that starting and ending that many calls alone sets.

        Call c reads the rows after call c - 1's, in whole rows (at least one); a call that would
        run past the matrix's end starts again at row 0, which the whole matrix has long since
        pushed out of every cache."""
        counts = np.array([max(1, -(-b // (_ROW_FLOATS * 4))) for b in call_bytes], dtype=np.int64)
        if counts.max(initial=0) > self._rows:
            raise ValueError(f"a call of {int(counts.max()) * _ROW_FLOATS * 4} bytes does not fit the "
                             f"{self.matrix_bytes}-byte matrix")
        starts, at = np.zeros_like(counts), 0
        for c, n in enumerate(counts.tolist()):
            at = 0 if at + n > self._rows else at
            starts[c], at = at, at + n
        covered = np.zeros(self._rows, dtype=bool)
        for r0, n in zip(starts.tolist(), counts.tolist()):
            covered[r0:r0 + n] = True
        whole, cut = [], []
        for _ in range(passes):
            for calls, rows, times in ((self._every_row, slice(None), whole), ((starts, counts), covered, cut)):
                self.y.fill(0.0)
                t0 = time.perf_counter()
                self._pass(*calls)
                times.append(time.perf_counter() - t0)
                if not np.all(self.y[rows] == _ROW_FLOATS):
                    raise RuntimeError("the bandwidth GEMV computed a wrong result")
        cut_bytes = int(counts.sum()) * _ROW_FLOATS * 4
        whole_rate, cut_rate = self.matrix_bytes / min(whole), cut_bytes / min(cut)
        return {"calls": len(counts), "call_bytes": cut_bytes, "passes": passes, "method": self.method,
                "whole_bytes_per_s": whole_rate, "calls_bytes_per_s": cut_rate, "ratio": cut_rate / whole_rate}


def measure_bandwidth(matrix_bytes: int = GIB, passes: int = 8) -> Bandwidth:
    """Read rate of an f32 GEMV over a matrix of at least `matrix_bytes`; one untimed pass first."""
    return Stream(matrix_bytes).sample(passes)


def summarize(samples: list[tuple[str, Bandwidth]]) -> dict:
    """Samples taken through a run (each labelled with what had just run) → the rate to bound by."""
    rates = [b.bytes_per_s for _, b in samples]
    first = samples[0][1]
    methods = list(dict.fromkeys(b.method for _, b in samples))   # each stream chose its way
    return {"bytes_per_s": statistics.median(rates), "min_bytes_per_s": min(rates), "max_bytes_per_s": max(rates),
            "method": " | ".join(methods), "matrix_bytes": first.matrix_bytes, "threads": first.threads,
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
