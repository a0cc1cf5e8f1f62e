"""The host's thread team on a machine doing other work (`cpu_kernels.threads`, `stream_split.h`).

Counted, never timed: a GEMV batch finishes its work while one of its threads is held back,
the team follows the cores other work holds (a rule, then the real /proc with a real busy
process), and a team that changes between tokens changes no token.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest
import torch

from cpu_kernels import native_cpu, threads
from cpu_kernels.threads import Governor, Sample, parse_threads
from llama_base.errors import UserError
from seeded import gemv_jobs, run_gemvs, team

SHAPES = [(256, 2048), (64, 8192), (512, 512)]
native = pytest.mark.skipif(native_cpu._library() is None, reason="no native library")


@contextlib.contextmanager
def held(thread: int):
    lib = native_cpu.library()
    lib.native_hold_thread(thread)
    lib.native_taken_reset()
    try:
        yield lambda t: lib.native_taken(t)
    finally:
        lib.native_hold_thread(-1)


@native
@pytest.mark.usefixtures("native_isa")
@pytest.mark.parametrize("fmt", ["q4nx", "bf16"])
@pytest.mark.parametrize("late", [0, 1])
def test_a_gemv_batch_finishes_without_the_thread_held_back(fmt, late):
    """The held thread waits until every piece (conversion and blocks) is claimed, so the other
    takes all of them; the rows are the same bits as one thread's."""
    jobs, rows = gemv_jobs(fmt, SHAPES, seed=7), [n for n, _ in SHAPES]
    with team(1):
        want = run_gemvs(fmt, jobs, rows)
    with team(2), held(late) as taken:
        got = run_gemvs(fmt, jobs, rows)
        by_thread = [taken(0), taken(1)]
    assert by_thread[late] == 0, f"the held thread took {by_thread[late]} pieces"
    assert by_thread[1 - late] > len(SHAPES), "the other thread took every piece"
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"job {i} differs with thread {late} held"


@native
def test_without_a_hold_both_threads_take_pieces():
    """The counters are live: an unheld team of two shares a large batch (each thread's own
    contiguous share comes first)."""
    jobs, rows = gemv_jobs("q4nx", [(4096, 2048)] * 4, seed=3), [4096] * 4
    with team(2), held(-1) as taken:
        run_gemvs("q4nx", jobs, rows)
        assert taken(0) > 0 and taken(1) > 0


def _governor(most=2, cpus=2, team=None, fixed=None, others=()):
    """A governor fed windows in which other work held `others` cores, one window a tick."""
    feed = iter(others)
    state = {"t": 0.0, "busy": 0}

    def sample():
        if state["t"]:                       # the construction's first sample takes no window
            load = next(feed, None)
            if load is None:
                return None
            state["busy"] += round(load * 100)
        state["t"] += 1.0
        return Sample(state["t"], state["busy"], 0)

    g = Governor(most=most, cpus=cpus, fixed=fixed, sample=sample, hz=100)
    if team is not None:
        g.team = team
    return g


@pytest.mark.parametrize("cpus,team_now,others,want", [
    (2, 2, 0.0, 2), (2, 2, 0.4, 2), (2, 2, 0.7, 1), (2, 2, 1.0, 1), (2, 2, 2.0, 1),
    (2, 1, 1.0, 1), (2, 1, 0.5, 1), (2, 1, 0.2, 2),
    (8, 8, 1.0, 7), (8, 8, 4.0, 4), (8, 4, 0.0, 8), (8, 7, 1.0, 7), (8, 1, 7.9, 1),
])
def test_the_team_follows_the_cores_other_work_holds(cpus, team_now, others, want):
    assert _governor(most=cpus, cpus=cpus, team=team_now).decide(others) == want


def test_ticks_measure_windows_and_apply_the_team_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(threads, "WINDOW_S", 0.0)
    applied = []
    monkeypatch.setattr(torch, "set_num_threads", applied.append)
    g = _governor(others=(0.0, 1.0, 1.0, 0.1))
    assert [g.tick() for _ in range(4)] == [2, 1, 1, 2]
    assert applied == [2, 1, 2], "the team is set only when it changes"
    assert g.changes == 2 and g.steps == {("token", 2): 2, ("token", 1): 2}
    assert "other work held 0.1" in g.describe() and "2 changes" in g.describe()


def test_threads_fixed_never_move(monkeypatch):
    monkeypatch.setattr(threads, "WINDOW_S", 0.0)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    g = _governor(fixed=1, others=(0.0, 0.0, 0.0))
    assert [g.tick() for _ in range(3)] == [1, 1, 1]
    assert "fixed by THREADS=1" in g.describe()


@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5"])
def test_a_bad_thread_count_is_one_line(text):
    with pytest.raises(UserError, match="positive whole number"):
        parse_threads(text)
    assert parse_threads(" 3 ") == 3 and parse_threads("") is None


def test_the_cli_refuses_a_bad_thread_count_in_one_line():
    r = subprocess.run([sys.executable, "llama32_1b_inference.py", "--threads", "0", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--threads" in r.stderr


@pytest.mark.skipif(threads._proc_sample(threads._cpus()) is None, reason="no /proc to measure")
def test_a_busy_process_is_measured_as_a_core_held():
    """Real /proc, a real busy loop: over half a second it holds most of a core (a lower bound
    only: anything else the machine runs adds to it)."""
    cpus = threads._cpus()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)                       # started and running
        a = threads._proc_sample(cpus)
        time.sleep(0.6)
        b = threads._proc_sample(cpus)
    finally:
        hog.kill()
        hog.wait()
    others = ((b.busy - a.busy) - (b.own - a.own)) / 100 / (b.wall - a.wall)
    assert others >= 0.6, f"a busy loop measured as {others:.2f} cores"


def test_a_team_that_changes_between_tokens_changes_no_token(tmp_path, monkeypatch):
    """The same greedy answer from a session whose team alternates 2, 1, 2, ... token by token
    as from one fixed at one thread: the kernels give the same bits on any team."""
    from llama_runtime.generation.session import build_session

    s = build_session("embedded", "sim", max_context=256, cache_dir=tmp_path, log=lambda _: None, threads=1)
    ids = s.encode("Name three colours.")
    want = s.generate(ids, n_tokens=12).tokens
    monkeypatch.setattr(threads, "WINDOW_S", 0.0)
    alternating = _governor(others=[0.0, 1.0] * 64)
    monkeypatch.setattr(threads, "_governor", alternating)
    got = s.generate(ids, n_tokens=12, reuse_cache=False).tokens
    assert got == want
    sizes = {n for (_, n) in alternating.steps}
    assert sizes == {1, 2}, f"the team ran at {sizes} only"
