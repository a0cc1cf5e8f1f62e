"""The measurement every runtime goes through, inside its own child process.

A side provides a runner with the two calls of `verify.runner.Runner` — `prefill(ids)` and
`decode_step(token, pos)`, each returning a result whose `top1` is the greedy next token — and
this module times them the same way for all: TTFT is prompt ids in → first token chosen;
decode is `n_decode` greedy steps after the decode-length prompt, end tokens ignored so that
every runtime does the same number of steps. Each prompt length gets `warmup` untimed runs,
then `runs` timed ones (`runs × short_runs` for prompts up to `short_limit` tokens, the decode
steps following only the first `runs`); the parent takes medians.

A child can instead score chunks of text for perplexity, untimed (`verify.scoring`; the side's
runner then also has `score(ids)`), or serve decode turns (`serve_turns`, see `bench.turns`):
stay loaded and decode a short burst each time the parent asks, so the runtimes' bursts can
alternate within seconds of each other, or only be built (`PREPARE`), untimed, so that the
caches a first build fills are full before anything is timed. A child measured under load
(`BUSY`) starts that many busy loops once loaded and stops them when done (`bench.load`). A child of the depth sweep
(`DEPTH`) times one deep prompt's TTFT and the decode steps after it (`measure_depth`); its
prepare job (`DEPTHS`) asks our side to compile what those prompts will call.

Standard library only (and `verify.scoring`, which is too): the llama.cpp side imports this
under an interpreter that has nothing but llama-cpp-python.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# The folder holding the `bench` package: every child, under any interpreter, imports its side from here.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
JOB_FILE = "job.json"
RESULT_FILE = "result.json"
TURN_FDS = "turn_fds"     # job key: the child's (command, reply) pipe descriptors when it serves turns
PERPLEXITY = "perplexity"  # job key: chunks of token ids to score (`verify.scoring`) instead of timing
PREPARE = "prepare"        # job key: build the runtime and stop, filling the caches its first load fills
DECODE_SPLIT = "decode_split"  # result key of a prepare job: a decode step inside and outside the device's runs
DEPTH = "depth"            # job key: time this one prompt length's TTFT and decode (`measure_depth`)
DEPTH_WARMUP = "depth_warmup"   # job key: [prompt ids, decode steps] of a depth child's untimed warm-up
DEPTHS = "depths"          # job key of a prepare job: the depths the sweep will time, to compile for
BUSY = "busy_cores"        # job key: measure with this many busy loops running beside (`bench.load`)
BUSY_START_S = 0.3         # the loops run this long before the first timed call: already on their cores


def turn_pipes(job: dict):
    """The (commands, replies) files of a child that serves decode turns, from its job's
    `TURN_FDS`: a runtime's child or the bandwidth child (`bench.bandwidth`)."""
    cmd_fd, reply_fd = job[TURN_FDS]
    return os.fdopen(cmd_fd, "r"), os.fdopen(reply_fd, "w")


def child_env() -> dict:
    """Every child's environment: offline, quiet, and the project importable from any interpreter."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])))


def peak_rss_bytes() -> int:
    """This process's peak resident memory.

    VmHWM rather than ru_maxrss: a child's ru_maxrss can include what its parent had resident
    when it was forked, which would credit a runtime with the harness's memory.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


@contextlib.contextmanager
def busy_loops(n: int):
    """`n` single-threaded busy processes while the block runs; yields a callable that gives
    the cores they ran on so far (their CPU time over the wall time since they started)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    t0 = time.perf_counter()
    try:
        time.sleep(BUSY_START_S if n else 0)

        def held() -> float | None:
            ns = [_cpu_ns(p.pid) for p in procs]
            if not procs or None in ns:
                return None
            return sum(ns) / 1e9 / (time.perf_counter() - t0)
        yield held
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _cpu_ns(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def measure(runner, prompts: dict[int, list[int]], decode_length: int, n_decode: int, runs: int,
            warmup: int, short_runs: int = 1, short_limit: int = 0) -> dict:
    ttft: dict[str, list[float]] = {}
    decode: list[float] = []
    for length in sorted(prompts):
        ids = prompts[length]
        times = []
        timed = runs * (short_runs if length <= short_limit else 1)
        for r in range(warmup + timed):
            t0 = time.perf_counter()
            tok = runner.prefill(ids).top1
            t1 = time.perf_counter()
            if length == decode_length and r < warmup + runs:
                pos = len(ids)
                for _ in range(n_decode):
                    tok = runner.decode_step(tok, pos).top1
                    pos += 1
                if r >= warmup:
                    decode.append(n_decode / (time.perf_counter() - t1))
            if r >= warmup:
                times.append(t1 - t0)
        ttft[str(length)] = times
    return {"ttft_s": ttft, "decode_tok_s": decode}


def measure_depth(runner, ids: list[int], n_decode: int, warmup_tokens: int = 0, warmup_steps: int = 0) -> dict:
    """One deep prompt: an untimed warm-up on its first `warmup_tokens` ids and `warmup_steps`
    decode steps after them (threads started, buffers made, programs recorded), then the whole
    prompt's TTFT and `n_decode` greedy steps after it, timed as `measure` times them."""
    if warmup_tokens:
        warm = ids[:warmup_tokens]
        tok = runner.prefill(warm).top1
        for i in range(warmup_steps):
            tok = runner.decode_step(tok, len(warm) + i).top1
    out = measure(runner, {len(ids): ids}, len(ids), n_decode, runs=1, warmup=0)
    return {"ttft_s": out["ttft_s"][str(len(ids))][0], "decode_tok_s": out["decode_tok_s"][0]}


def serve_turns(runner, prompt: list[int], n_decode: int, commands, replies) -> int:
    """Decode bursts on request until the commands end: a line "n" in → n greedy steps → their seconds out.

    Positions stay among those the rounds time (the prompt's length up to n_decode past it): a
    burst that would go further first prefills the prompt again, untimed. Returns the bursts served.
    """
    end = len(prompt) + n_decode
    pos = end
    served = 0
    for line in commands:
        steps = int(line)
        if not 0 < steps <= n_decode:
            raise ValueError(f"a burst of {steps} decode steps; the plan times 1..{n_decode}")
        if pos + steps > end:
            tok, pos = runner.prefill(prompt).top1, len(prompt)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = runner.decode_step(tok, pos).top1
            pos += 1
        replies.write(f"{time.perf_counter() - t0!r}\n")
        replies.flush()
        served += 1
    return served


def exit_description(workdir: Path, returncode: int) -> str:
    """For the parent: how a child that wrote no error of its own ended, with the last lines of its log."""
    how = f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exit status {returncode}"
    tail = (workdir / "child.log").read_text(errors="replace").strip().splitlines()[-3:]
    return f"{how}: " + " | ".join(tail)


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start-up included), from /proc."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def child_main(make_runner: Callable[[dict], tuple[object, dict]], argv: list[str] | None = None) -> int:
    """Entry point of a side: job.json in, result.json out (with load time, peak memory, extras).

    `make_runner(job)` returns the runner and a dict of facts the side wants reported (versions,
    settings, sizes). Failures are written to the result, so the parent can report them.
    """
    workdir = Path((argv if argv is not None else sys.argv[1:])[0])
    job = json.loads((workdir / JOB_FILE).read_text())
    result: dict = {}
    try:
        t0 = time.perf_counter()
        runner, info = make_runner(job)
        # Process start to ready: what a user waits for, imports included.
        age = process_age_s()
        result["load_s"] = age if age is not None else time.perf_counter() - t0
        result["info"] = info
        prompts = {int(k): v for k, v in job["prompts"].items()}
        if PERPLEXITY in job:
            from verify.scoring import score_chunks

            t0 = time.perf_counter()
            result[PERPLEXITY] = {**score_chunks(runner, job[PERPLEXITY]), "seconds": time.perf_counter() - t0}
        elif TURN_FDS in job:
            commands, replies = turn_pipes(job)
            with commands, replies:
                result["turns"] = serve_turns(runner, prompts[job["decode_length"]], job["n_decode"], commands,
                                              replies)
        elif DEPTH in job and not job.get(PREPARE):
            result.update(measure_depth(runner, prompts[job[DEPTH]], job["n_decode"], *job.get(DEPTH_WARMUP, (0, 0))))
        elif not job.get(PREPARE):
            with busy_loops(job.get(BUSY, 0)) as held:
                result.update(measure(runner, prompts, job["decode_length"], job["n_decode"], job["runs"],
                                      job["warmup"], job.get("short_runs", 1), job.get("short_limit", 0)))
                if job.get(BUSY):
                    result["busy"] = {"cores": job[BUSY], "held_cores": held()}
        elif DEPTHS in job:
            if hasattr(runner, "compile_depths"):   # ours: attention groups of each chunk's offset, fused windows
                result["depth_groups_compiled"] = runner.compile_depths(job[DEPTHS], job["n_decode"])
        elif hasattr(runner, "decode_split"):   # ours: the bench's peers have no device to split by
            # Untimed, so a profiler may run: no timed step carries its cost.
            result[DECODE_SPLIT] = runner.decode_split(prompts[job["decode_length"]], job["n_decode"])
        if hasattr(runner, "facts"):            # what the run itself changed (kernel groups it compiled)
            result["info"].update(runner.facts())
    except Exception as e:  # reported by the parent as this runtime's note
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    result["peak_rss_bytes"] = peak_rss_bytes()
    (workdir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if "error" not in result else 1
