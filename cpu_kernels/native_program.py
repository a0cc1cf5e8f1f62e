"""Native calls recorded once and replayed at a position in one call (`native/program_cpu.cc`).

The simulated device already runs each launch as a native call with its pointers fixed
(`native_cpu._bound`); what a decode token still pays is the interpreter between those calls,
run from caches the GEMVs have just flushed. A `NativeProgram` holds such calls and the byte
copies between them (a buffer's sync, an activation handed to the next call) as one table,
and `run(pos)` makes them all in one call. Arguments that follow the token's position (a KV
row's address, a RoPE table row, an attention's length) are recorded with a step per position;
the resident cache's kernels read the position through a pointer instead, and need none.

Which functions it replays, and their argument kinds, are the library's table
(`native_cpu.replayed_functions`, from the prototypes in native/replayed.h). A call outside it
raises `ReplayError` naming the function and its signature: the program is only made by a
device that declared it can record (`npu_runtime.api.Recorder`), so what it cannot replay is a
bug to see, not a token to run some other way.

A program holds raw addresses: it keeps references to what they point into (`hold`), and its
owner must drop it when any of that storage may have been replaced.
"""
from __future__ import annotations

import ctypes
import struct
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import numpy as np

from cpu_kernels import native_cpu

_KINDS = {t: k for k, t in native_cpu.ARG_TYPES.items()}    # ctypes type -> its kind's letter


class ReplayError(RuntimeError):
    """A call a native program cannot replay: a function outside the library's table, argument
    types that are not the table's, or a body that is not a native call at all."""


def signature(fn) -> str:
    """The kinds of `fn`'s ctypes `argtypes`, one letter each ("?" for a type no kind carries)."""
    return "".join(_KINDS.get(t, "?") for t in (fn.argtypes or ()))


class NativeProgram:
    """An append-only list of native calls; `run(pos)` replays them in order."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self._max_args = lib.native_program_max_args()
        self._functions: dict[str, tuple[int, str]] = lib.replayed
        self._copy = lib.native_program_copy
        self._ops: list[list[int]] = []
        self._labels: list[object] = []
        self._holds: list[object] = []
        self._checks: list = []       # the status checks of the calls that may refuse (`bound`)
        self._counts: dict[int, list] = {}
        self._table = None
        self._label_ids: tuple[list, np.ndarray] | None = None    # made with the table
        self.label: object = None     # given to each op appended, for a timed run's totals
        self.tallies: dict[object, int] = {}

    @classmethod
    def new(cls) -> NativeProgram:
        """An empty program on the chosen class's library; `ReplayError` where there is none
        (the torch class: a device there declares it cannot record)."""
        lib = native_cpu.library()
        if lib is None:
            raise ReplayError("no native library (the torch class): there is nothing to replay calls with")
        return cls(lib)

    def __len__(self) -> int:
        return len(self._ops)

    def labelled(self) -> Counter:
        """How many ops each label has: what a recording's coverage is checked by."""
        return Counter(self._labels)

    def _op(self, code: int, fn: int, args: list[int], steps: list[int]) -> None:
        pad = [0] * (self._max_args - len(args))
        self._ops.append([code, fn, *args, *pad, *steps, *pad])
        self._labels.append(self.label)
        self._table = None

    def copy(self, dst: int, src: int, nbytes: int, src_step: int = 0) -> None:
        """memmove(dst, src + pos · src_step, nbytes)."""
        self.call(self._copy, (dst, src, nbytes), (0, src_step, 0))

    def call(self, fn, args: tuple, steps: tuple = ()) -> None:
        """`fn` (a function of the native library, its `argtypes` set) with `args`, argument i
        plus pos · steps[i]; ints stand for addresses. `ReplayError`, naming the function and
        its signature, where the table has no such function, its `argtypes` are not the table's
        kinds, or an argument is not an int, a float or a ctypes array of its kind."""
        name, have = fn.__name__, signature(fn)
        entry = self._functions.get(name)
        if entry is None:
            raise ReplayError(f"{name}({have}): not a function the native program replays "
                              f"(program_cpu.cc replays {', '.join(self._functions)})")
        code, kinds = entry
        if have != kinds:
            raise ReplayError(f"{name}: its argtypes say ({have}), the library's table ({kinds})")
        if len(args) != len(kinds) or len(steps) > len(kinds):
            raise ReplayError(f"{name}({kinds}): {len(args)} arguments and {len(steps)} steps")
        words = []
        for i, (kind, a) in enumerate(zip(kinds, args)):
            if kind == "f" and isinstance(a, (int, float)):
                words.append(struct.unpack("<I", struct.pack("<f", a))[0])
            elif kind != "f" and isinstance(a, ctypes.Array):
                words.append(ctypes.addressof(a))
                self._holds.append(a)
            elif kind != "f" and isinstance(a, int):
                words.append(a)
            else:
                raise ReplayError(f"{name}({kinds}): argument {i} is a {type(a).__name__}, not a {kind!r} word")
        self._op(code, ctypes.cast(fn, ctypes.c_void_p).value, words, list(steps) + [0] * (len(args) - len(steps)))
        self._holds.append(fn)

    def bound(self, call) -> None:
        """A bound native call (`native_cpu.NativeCall`): its function and arguments, fixed.
        `ReplayError` for anything else (a torch body the device bound instead), named. A call
        whose kernel may refuse what it reads when it runs (`native_cpu.CheckedCall`: a position
        outside the cache) is checked after each run, which raises as the call would have."""
        if not isinstance(call, native_cpu.NativeCall) or call.keywords:
            body = call.func if isinstance(call, partial) else call
            raise ReplayError(f"{getattr(body, '__name__', type(body).__name__)}: not a native call, "
                              "which a native program cannot replay")
        self.call(call.func, call.args)
        self._holds.append(call)
        if isinstance(call, native_cpu.CheckedCall):
            self._checks.append(call.check)

    def hold(self, *objects: object) -> None:
        """Keep `objects` alive as long as the program: recorded addresses point into them."""
        self._holds.extend(objects)

    def tally(self, key: object) -> None:
        """Count one `key` (a run of a group, a host op) in `tallies`: what a profiled run's
        totals are divided among."""
        self.tallies[key] = self.tallies.get(key, 0) + 1

    @contextmanager
    def host_op(self, name: str) -> Iterator[None]:
        """The ops appended inside, labelled and tallied as one run of the host op `name`, as
        the profiler's `host_op` times the loop's (("host", name): what a profiled run reports)."""
        self.label = ("host", name)
        self.tally(self.label)
        try:
            yield
        finally:
            self.label = None

    def count(self, counters, **add: int) -> None:
        """Add `add` to `counters`' fields on every run, as the calls recorded would have."""
        entry = self._counts.setdefault(id(counters), [counters, {}])
        for name, n in add.items():
            entry[1][name] = entry[1].get(name, 0) + n

    def run(self, pos: int, timed: bool = False) -> dict[object, float] | None:
        """Every op at `pos`; with `timed`, the seconds spent under each label (summed by
        numpy: a decode token has several hundred ops, and the profiler should not add a
        Python loop over them to the host's share it measures)."""
        if self._table is None:
            flat = [w for op in self._ops for w in op]
            self._table = (ctypes.c_int64 * len(flat))(*flat)
            names = list(dict.fromkeys(self._labels))
            self._label_ids = (names, np.array([names.index(x) for x in self._labels], dtype=np.int64))
        ns = (ctypes.c_int64 * len(self._ops))() if timed else None
        failed = self._lib.native_program_run(ctypes.addressof(self._table), len(self._ops), pos,
                                              ctypes.addressof(ns) if timed else None)
        if failed >= 0:
            raise RuntimeError(f"native program: op {failed} has an unknown code")
        for check in self._checks:
            check()
        for counters, add in self._counts.values():
            for name, n in add.items():
                setattr(counters, name, getattr(counters, name) + n)
        if not timed:
            return None
        names, ids = self._label_ids
        sums = np.bincount(ids, weights=np.frombuffer(ns, dtype=np.int64), minlength=len(names))
        return {name: float(t) * 1e-9 for name, t in zip(names, sums)}
