"""Decode in turns: every runtime loaded at once, short decode bursts taken in alternation.

The hosts this runs on share their memory system with other guests, and its bandwidth jumps
between levels (seen: about 33 and about 53 GB/s) within seconds. A decode timed once per round
lands on whichever level holds for those seconds, so one round can hand one runtime the fast
level and its peer the slow one, and a ratio of single runs says more about the host than about
the runtimes (rounds of the same two programs have ranged from 1.03× to 1.76×). Here every
runtime stays loaded in its own child, idle between bursts, and each turn runs one burst of
`turn_steps` decode steps of every runtime, in a shuffled order, so the bursts of one turn are
seconds apart. A decode ratio is then the median over turns of the ratio within each turn, and
a runtime's decode rate the median of its bursts. The bound moves with the host too, so the
bandwidth is sampled in every turn as well, by a child of its own taking its place in the
shuffled order: a burst is held against the bound of its own turn.

Only one child runs at a time: the others block on their command pipe, so the one being timed
has both cores and the memory system to itself, as in the rounds. A child's answer does not
mean its threads have stopped: OpenMP's default wait keeps a runtime's worker threads spinning
for some milliseconds after its last parallel region, and a burst started then shares the cores
with them (the first step of a 1B-shape Q4NX burst right after the bandwidth child took 25 ms
instead of about 19). So a burst ends only once the child's threads have stopped running.
The children do share the machine's memory, which is why the turns are skipped (with a note)
when the runtimes' peaks from the rounds do not fit in what is available.
"""
from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import BenchError
from bench.machine import meminfo_bytes
from bench.protocol import JOB_FILE, RESULT_FILE, TURN_FDS, exit_description

TURN_TIMEOUT_S = 1800     # a burst (the first one loads the runtime) not answered by then: hung
MEMORY_HEADROOM = 1.25    # the runtimes' peaks times this must fit in the available memory
BANDWIDTH = "bandwidth"   # the series of the bandwidth child: bytes/s in each turn
BANDWIDTH_PASSES = 4      # a turn's bandwidth sample: the fastest of this many passes
QUIET_S = 0.005           # a child has gone quiet once its threads ran for almost none of this long
QUIET_CPU = 0.05          # "almost none": this fraction of the window
QUIET_MAX_S = 2.0         # a child still running after this long is left running


class TurnChild:
    """One runtime's child, serving bursts over a pair of pipes (`bench.protocol.serve_turns`)."""

    def __init__(self, name: str, module: str, job: dict, workdir: Path, python: str, env: dict, cwd: Path):
        self.name = name
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        (workdir / JOB_FILE).write_text(json.dumps({**job, TURN_FDS: [cmd_r, reply_w]}))
        try:
            with open(workdir / "child.log", "w") as out:
                self.proc = subprocess.Popen([python, "-m", module, str(workdir)], env=env, stdout=out,
                                             stderr=subprocess.STDOUT, cwd=cwd, pass_fds=(cmd_r, reply_w))
        except OSError as e:
            os.close(cmd_w)
            os.close(reply_r)
            raise BenchError(f"could not start {python}: {e}") from None
        finally:          # the child's ends: it holds its own copies
            os.close(cmd_r)
            os.close(reply_w)
        self.commands = os.fdopen(cmd_w, "w")
        self.replies = os.fdopen(reply_r, "r")

    def burst(self, steps: int) -> float:
        """The child's answer to `steps`: the seconds its decode steps took (the bandwidth
        child's: bytes/s, the fastest of that many passes). BenchError if it died or hung."""
        try:
            self.commands.write(f"{steps}\n")
            self.commands.flush()
        except BrokenPipeError:
            raise BenchError(self._failure()) from None
        ready, _, _ = select.select([self.replies], [], [], TURN_TIMEOUT_S)
        if not ready:
            self.proc.kill()
            self.close()
            raise BenchError(f"no answer after {TURN_TIMEOUT_S} s: stopped")
        line = self.replies.readline()
        if not line:
            raise BenchError(self._failure())
        wait_quiet(self.proc.pid)
        return float(line)

    def _failure(self) -> str:
        self.close()
        result_file = self.workdir / RESULT_FILE
        err = json.loads(result_file.read_text()).get("error") if result_file.is_file() else None
        return err or exit_description(self.workdir, self.proc.returncode)

    def close(self) -> None:
        """End the child: closing its commands ends its loop; one that does not leave is killed."""
        for f in (self.commands, self.replies):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fitting_sides(model: str, sides: list, peaks: dict[str, int], extra: int, have: int | None,
                  notes: list[str]) -> list:
    """The sides that can be loaded together: all of them where their peaks (and `extra`) fit
    the available memory with headroom; else the first side (ours) and as many of the others,
    smallest peak first, as fit beside it (a larger model's bf16 peers are what an 8B cannot
    hold at once), the others named in a note; none where ours and one peer do not fit."""
    def need(names) -> int:
        return int((sum(peaks.get(n, 0) for n in names) + extra) * MEMORY_HEADROOM)

    names = [name for name, *_ in sides]
    if have is None or need(names) <= have:
        return sides
    kept = names[:1]
    for name in sorted(names[1:], key=lambda n: peaks.get(n, 0)):
        if need(kept + [name]) <= have:
            kept.append(name)
    if len(kept) < 2:
        notes.append(f"{model}: decode turns skipped: the runtimes' peaks need {need(names) / 2**30:.1f} GiB "
                     f"together, {have / 2**30:.1f} GiB is available; decode is from the rounds alone.")
        return []
    left = [n for n in names if n not in kept]
    notes.append(f"{model}: {', '.join(left)} left out of the decode turns: all the runtimes' peaks need "
                 f"{need(names) / 2**30:.1f} GiB together and {have / 2**30:.1f} GiB is available; "
                 "their decode is from the rounds alone.")
    return [s for s in sides if s[0] in kept]


def decode_turns(model: str, sides: list[tuple[str, str, dict, str]], turns: int, steps: int, workdir: Path,
                 env: dict, cwd: Path, notes: list[str], log: Callable[[str], None] = print,
                 peaks: dict[str, int] | None = None,
                 bandwidth_bytes: int | None = None) -> dict[str, list[float | None]]:
    """Each side's decode rate (tokens/s) in each of `turns` turns, None where it had none.

    `sides` are (name, module, job, python) as for the rounds. Each child's first burst is a
    warm-up (it loads the runtime and prefills): untimed, taken before the next child starts,
    so no two runtimes ever load at once. A child that fails is left out with a note.
    With `bandwidth_bytes`, one more child takes its turn among them: the bandwidth GEMV over a
    matrix of that size (`bench.bandwidth`), whose rate in each turn, under `BANDWIDTH`, bounds
    the bursts of the same turn.
    """
    sides = fitting_sides(model, sides, peaks or {}, bandwidth_bytes or 0, meminfo_bytes("MemAvailable"), notes)
    if not sides:
        return {}
    if bandwidth_bytes:
        sides = [*sides, (BANDWIDTH, "bench.bandwidth", {"matrix_bytes": bandwidth_bytes}, sys.executable)]
    children: dict[str, TurnChild] = {}
    rates: dict[str, list[float | None]] = {}
    try:
        for name, module, job, python in sides:
            log(f"[bench] {model}: {name} loading for the decode turns ...")
            try:
                child = TurnChild(name, module, job, workdir / name.replace(" ", "-") / "turns", python, env, cwd)
                child.burst(_amount(name, steps))
            except BenchError as e:
                notes.append(f"{model}: {name} left out of the decode turns: {str(e).splitlines()[0]}")
                continue
            children[name] = child
            rates[name] = []
        rng = random.Random(0)
        log(f"[bench] {model}: {turns} decode turns of {steps} steps each ...")
        for _ in range(turns):
            for series in rates.values():
                series.append(None)
            order = list(children)
            rng.shuffle(order)
            for name in order:
                try:
                    answer = children[name].burst(_amount(name, steps))
                    rates[name][-1] = answer if name == BANDWIDTH else steps / answer
                except BenchError as e:
                    notes.append(f"{model}: {name} failed in the decode turns: {str(e).splitlines()[0]}")
                    children.pop(name)
    finally:
        for child in children.values():
            child.close()
    return rates


def _thread_files(pid: int, name: str) -> list[str] | None:
    """The file `name` of each thread of process `pid` (/proc/PID/task/TID/name), leaving out a
    thread that ended meanwhile; None where /proc does not list the threads."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    texts = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                texts.append(f.read())
        except OSError:
            pass
    return texts


def cpu_ns(pid: int) -> int | None:
    """The CPU time all threads of process `pid` have run, in ns (the scheduler's own count, not
    the clock ticks of /proc/PID/stat); None where /proc does not give it."""
    texts = _thread_files(pid, "schedstat")
    return None if texts is None else sum(int(t.split()[0]) for t in texts if t.split())


def runnable_threads(pid: int) -> int:
    """How many threads of process `pid` are running or waiting for a core (state R): a
    spinning thread the scheduler has set aside gains no CPU time, but stays runnable."""
    # The state is the field after the command, which is in parentheses and may hold spaces.
    return sum(t[t.rindex(")") + 2] == "R" for t in _thread_files(pid, "stat") or [] if ")" in t)


def wait_quiet(pid: int) -> float:
    """Wait until process `pid` has stopped running (its threads asleep or blocked): at most
    `QUIET_MAX_S`; at once where its CPU time cannot be read. Returns the seconds waited.

    Quiet takes both signs: almost no CPU time over a window, and no thread runnable at its end.
    CPU time alone was fooled on a busy host: a spinning thread kept off the cores for a whole
    window looks asleep by its count."""
    t0 = time.perf_counter()
    last = cpu_ns(pid)
    while last is not None and time.perf_counter() - t0 < QUIET_MAX_S:
        time.sleep(QUIET_S)
        now = cpu_ns(pid)
        if now is None or (now - last < QUIET_CPU * QUIET_S * 1e9 and not runnable_threads(pid)):
            break
        last = now
    return time.perf_counter() - t0


def _amount(name: str, steps: int) -> int:
    """What a child is asked for in a turn: decode steps, or the bandwidth child's passes."""
    return BANDWIDTH_PASSES if name == BANDWIDTH else steps
