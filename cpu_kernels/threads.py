"""How many threads the host kernels run on: the cores other processes leave free, measured.

Every parallel kernel is an OpenMP region that ends when its last thread does. A thread whose
core another process holds runs only when the scheduler gives it a slice, milliseconds later,
and a decode token crosses hundreds of regions: on a 2-core Zen 3 with one busy process beside
it, the embedded model decoded at 0.76 tokens/s on two threads and 18.7 on one. Handing work
out in pieces any thread may take (`native/stream_split.h`) shortens the wait for a late
thread's share, not the wait for the thread itself. So the team is sized to the cores that
are free.

Free is measured, not guessed: over each window of at least `WINDOW_S`, the busy time the
kernel accounts to the CPUs this process may run on (`/proc/stat`, steal included: a
hypervisor's guests are other work too), less this process's own (`/proc/self/stat`, the same
clock ticks), is the cores other work held. A team shrinks when fewer than `team - DROP_AT`
cores are free, and grows when at least `team + 1 - GROW_AT` are: a busy loop beside us holds
one core whatever our team is, a browser's few per cent hold none. Sampling costs two small
file reads per window, at the decode and prefill boundaries that call `tick`.

`THREADS=N` (`--threads N`, `LLAMA_NPU_THREADS`) fixes the team instead. Without `/proc`
the team stays at its start size (torch's, or `OMP_NUM_THREADS`).

The team size is the OpenMP ICV of the calling thread, so it is applied on the thread that
runs the kernels (a server's worker is not the main thread). The kernels give the same bits on
any team (tests/test_threads.py), so a change between two tokens never changes a result.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from llama_base.errors import UserError

ENV_THREADS = "LLAMA_NPU_THREADS"
WINDOW_S = 0.1      # shortest measurement window: /proc/stat counts in 10 ms ticks per CPU
DROP_AT = 0.5       # leave a thread when the free cores fall half a core below the team
GROW_AT = 0.3       # take one back when all but 0.3 of another core is free
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)   # user nice system irq softirq steal (guest time is inside user)


def parse_threads(text: str | None) -> int | None:
    """THREADS / --threads / LLAMA_NPU_THREADS: a positive whole number, or unset."""
    if text is None or str(text).strip() == "":
        return None
    try:
        n = int(str(text).strip())
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(f"THREADS={text!r}: expected a positive whole number of threads")
    return n


@dataclass(frozen=True)
class Sample:
    wall: float
    busy: int     # ticks, summed over this process's CPUs
    own: int      # this process's ticks


def _proc_sample(cpus: frozenset[int]) -> Sample | None:
    """Busy and own ticks now, or None where /proc does not say."""
    try:
        busy = 0
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu") or line[3:4] == b" ":
                    continue
                name, *ticks = line.split()
                if int(name[3:]) in cpus:
                    busy += sum(int(ticks[i]) for i in _BUSY_FIELDS if i < len(ticks))
        with open("/proc/self/stat", "rb") as f:
            after_comm = f.read().rsplit(b")", 1)[1].split()
        own = int(after_comm[11]) + int(after_comm[12])   # utime, stime (fields 14 and 15)
    except (OSError, ValueError, IndexError):
        return None
    return Sample(time.monotonic(), busy, own)


def _cpus() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


@dataclass
class Governor:
    """The team size, from windows of `sample()`; `decide` is the rule, kept pure for the tests."""
    most: int                               # the team at start: never more
    cpus: int                               # CPUs this process may run on
    fixed: int | None = None                # THREADS=N
    sample: Callable[[], Sample | None] = lambda: None
    hz: int = 100
    team: int = 0
    others: float = 0.0                     # cores other work held in the last window
    reason: str = ""
    steps: dict[tuple[str, int], int] = field(default_factory=dict)   # (what, team): boundaries run
    changes: int = 0
    _last: Sample | None = None
    _applied: threading.local = field(default_factory=threading.local)

    def __post_init__(self) -> None:
        if self.fixed is not None:
            self.team = self.fixed
            self.reason = f"fixed by THREADS={self.fixed}"
            return
        self.team = self.most
        self._last = self.sample()
        self.reason = (f"{self.most}: the start size; no /proc to measure free cores" if self._last is None
                       else f"{self.most}: the start size, not yet measured")

    def decide(self, others: float) -> int:
        """The team for a window in which other work held `others` cores."""
        free = self.cpus - others
        team = self.team
        if team > 1 and free < team - DROP_AT:
            team = max(1, int(free + 0.5))
        elif team < self.most and free >= team + 1 - GROW_AT:
            team = min(self.most, int(free + GROW_AT))
        return team

    def tick(self, what: str = "token") -> int:
        """Before a decode token or a prefill layer (`what`): measure if a window has passed, then
        apply the team on this thread. Returns the team size the next kernels run on."""
        if self.fixed is None and self._last is not None:
            now = time.monotonic()
            if now - self._last.wall >= WINDOW_S:
                s = self.sample()
                if s is not None:
                    wall = s.wall - self._last.wall
                    self.others = max(0.0, ((s.busy - self._last.busy) - (s.own - self._last.own)) / self.hz / wall)
                    self._last = s
                    team = self.decide(self.others)
                    if team != self.team:
                        self.changes += 1
                        self.team = team
                    self.reason = (f"{self.team} of {self.cpus} CPUs: other work held {self.others:.1f} "
                                   f"of them in the last {wall * 1e3:.0f} ms")
        key = (what, self.team)
        self.steps[key] = self.steps.get(key, 0) + 1
        if getattr(self._applied, "team", None) != self.team:
            torch.set_num_threads(self.team)
            self._applied.team = self.team
        return self.team

    def describe(self) -> str:
        """What `make profile` prints: the team, why, and how often each size ran."""
        runs = ", ".join(f"{c} {what}{'s' * (c > 1)} on {n}" for (what, n), c in sorted(self.steps.items()))
        mode = ("fixed" if self.fixed is not None else
                f"adaptive up to {self.most}, {self.changes} change{'s' * (self.changes != 1)}")
        return f"threads: {self.reason} ({mode}; {runs or 'nothing run yet'})"


_governor: Governor | None = None
_lock = threading.Lock()


def configure(fixed: int | None = None) -> Governor:
    """The process's governor (one OpenMP team per process), made or remade: `fixed` (or
    LLAMA_NPU_THREADS) pins the team, else it adapts from torch's current size down."""
    global _governor
    if fixed is None:
        fixed = parse_threads(os.environ.get(ENV_THREADS))
    with _lock:
        most = _governor.most if _governor is not None else torch.get_num_threads()
        cpus = _cpus()
        _governor = Governor(most=max(most, 1), cpus=len(cpus), fixed=fixed, sample=lambda: _proc_sample(cpus),
                             hz=os.sysconf("SC_CLK_TCK"))
        return _governor


def governor() -> Governor:
    return _governor if _governor is not None else configure()


def tick(what: str = "token") -> int:
    return governor().tick(what)
