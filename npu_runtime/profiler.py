"""Per-call timing of device calls and host ops, for `make profile` and `make bench`.

A disabled profiler is a single attribute check at each call site, and its `host_op` hands
back one shared do-nothing context: between two decode GEMVs the interpreter runs from cold
caches, where even building a generator-based context costs microseconds, a few dozen times
a token.
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

_UNTIMED = nullcontext()      # what a disabled profiler's host_op returns: stateless, so shared


@dataclass
class CallStats:
    calls: int = 0
    write_s: float = 0.0
    run_s: float = 0.0
    read_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.write_s + self.run_s + self.read_s


@dataclass
class Profiler:
    enabled: bool = True
    groups: dict[str, CallStats] = field(default_factory=dict)
    host: dict[str, CallStats] = field(default_factory=dict)

    def record_call(self, group: str, write_s: float, run_s: float, read_s: float, calls: int = 1) -> None:
        s = self.groups.setdefault(group, CallStats())
        s.calls += calls
        s.write_s += write_s
        s.run_s += run_s
        s.read_s += read_s

    def record_host(self, name: str, seconds: float, calls: int = 1) -> None:
        """Host ops timed elsewhere (a native program's, `DecodeProgram`)."""
        s = self.host.setdefault(name, CallStats())
        s.calls += calls
        s.run_s += seconds

    def host_op(self, name: str) -> AbstractContextManager:
        return self._timed(name) if self.enabled else _UNTIMED

    @contextmanager
    def _timed(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.record_host(name, time.perf_counter() - t0)

    def reset(self) -> None:
        self.groups.clear()
        self.host.clear()

    def table(self) -> str:
        """Per group: calls, total and per-call ms, split into BO write / run / read; then host ops."""
        lines = [f"{'device call':<24}{'calls':>7}{'total ms':>11}{'ms/call':>9}{'write':>9}{'run':>10}{'read':>9}"]
        for name, s in sorted(self.groups.items(), key=lambda kv: -kv[1].total_s):
            lines.append(f"{name:<24}{s.calls:>7}{s.total_s * 1e3:>11.1f}{s.total_s * 1e3 / s.calls:>9.2f}"
                         f"{s.write_s * 1e3:>9.1f}{s.run_s * 1e3:>10.1f}{s.read_s * 1e3:>9.1f}")
        lines.append(f"{'host op':<24}{'calls':>7}{'total ms':>11}{'ms/call':>9}")
        for name, s in sorted(self.host.items(), key=lambda kv: -kv[1].run_s):
            lines.append(f"{name:<24}{s.calls:>7}{s.run_s * 1e3:>11.1f}{s.run_s * 1e3 / s.calls:>9.3f}")
        return "\n".join(lines)


NULL_PROFILER = Profiler(enabled=False)
