"""Peak resident memory of our side of the bench, step by step, in one process.

    python -m bench.peak_memory --model llama1b-shape --quant q4nx
    python -m bench.peak_memory --model llama1b-shape --depth 32768

Builds the session as `bench/side_ours.py` does, then runs the bench's sequence through the
same `measure` (every prompt length's warm-up and timed prefills, the decode steps after the
decode prompt) and reports the process's VmHWM, which is what the bench reports as peak
memory. Each step's own peak is read too: the high-water mark is reset between steps
(`/proc/self/clear_refs`, Linux 4.0 and later), so the table says which step sets the peak
and what is resident after it. The KernelCache's buffers are summed by what they hold
(weights, activations per group) beside it. Standard measurement only: no tracemalloc, which
would itself cost memory and time.

With `--depth N` the sequence is the depth sweep's instead (`bench.plan`): the session holds
N positions and the plan's decode steps past them, a short prompt (the plan's shallowest
depth) and then N positions are prefilled, each followed by its decode steps, and the peak at N
is held against what it should be (`depth_memory`): the weights, the KV cache the positions
actually wrote, and the fixed overhead the short prompt's peak left beyond its weights and KV.
The bench reads its own children's peaks with the same arithmetic.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Start a new high-water mark at the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Steps:
    """Runs named steps, each with its own peak (when resettable) and the RSS after it."""

    def __init__(self, log: Callable[[str], None]):
        self.rows: list[dict] = []
        self.peak = 0
        self.resettable = reset_peak()
        self.log = log

    def run(self, name: str, fn: Callable[[], object]) -> object:
        if self.resettable:
            reset_peak()
        t0 = time.perf_counter()
        result = fn()
        s = status()
        self.peak = max(self.peak, s["VmHWM"])
        row = {"step": name, "seconds": time.perf_counter() - t0, "step_peak": s["VmHWM"], "rss": s["VmRSS"],
               "anon": s["RssAnon"], "file": s["RssFile"]}
        self.rows.append(row)
        self.log(f"{name:<34} peak {s['VmHWM'] / GIB:6.3f} GiB   after: rss {s['VmRSS'] / GIB:6.3f} "
                 f"(anon {s['RssAnon'] / GIB:5.3f}, file {s['RssFile'] / GIB:5.3f})   {row['seconds']:6.1f} s")
        return result


def resident_by_mapping(top: int = 6) -> list[tuple[str, int]]:
    """The largest resident mappings (/proc/self/smaps): file-backed ones by file name, the heap,
    and anonymous mappings together."""
    rows: dict[str, int] = {}
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else "[anon]"
            elif head and head[0] == "Rss:":
                rows[name] = rows.get(name, 0) + int(head[1]) * 1024
    return sorted(rows.items(), key=lambda kv: -kv[1])[:top]


def depth_memory(peak_short: int, peak_deep: int, weight_bytes: int, kv_bytes_per_position: int,
                 short_positions: int, deep_positions: int) -> dict:
    """The peak at a deep context against weights + the KV written there + the fixed overhead
    measured at a short one (its peak less its weights and its own KV written): `ratio` is
    1.0 where memory grew by exactly the deep context's extra KV, and more by what else grew."""
    kv_short = short_positions * kv_bytes_per_position
    kv_deep = deep_positions * kv_bytes_per_position
    overhead = peak_short - weight_bytes - kv_short
    expected = weight_bytes + kv_deep + overhead
    return {"short_positions": short_positions, "deep_positions": deep_positions, "peak_short_bytes": peak_short,
            "peak_deep_bytes": peak_deep, "weight_bytes": weight_bytes, "kv_bytes_per_position": kv_bytes_per_position,
            "kv_short_bytes": kv_short, "kv_deep_bytes": kv_deep, "overhead_bytes": overhead,
            "expected_bytes": expected, "ratio": peak_deep / expected if expected > 0 else None}


def buffer_breakdown(kc) -> dict[str, int]:
    """The KernelCache's BO bytes: weights, then the activation buffers by pool."""
    out: dict[str, int] = {"weights (static BOs)": kc.resident_bytes()["static"]}
    for pool, nbytes in sorted(kc.activation_bytes_by_pool().items()):
        out[f"activations: {pool}"] = nbytes
    out["activations, total"] = kc.resident_bytes()["activations"]
    return out


def _parser() -> argparse.ArgumentParser:
    """The command line, built once the runtime is imported (`main`): the shared flags' module
    loads torch, whose memory the first steps must not yet hold."""
    from llama_runtime.checkpoints.resolve import LLAMA1B_SHAPE
    from llama_runtime.cli.options import add_model_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(ap, model=LLAMA1B_SHAPE, device="sim", quant="q4nx", decode=True)
    ap.add_argument("--buckets", help="prefill buckets, comma-separated (default: the session's own)")
    ap.add_argument("--depth", type=int, help="run the depth sweep's sequence to this many positions instead, "
                                                "against weights + KV written + the overhead at a short prompt")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    return ap


def main(argv: list[str] | None = None) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    steps = Steps(log)
    if not steps.resettable:
        log("(this kernel cannot reset VmHWM: each step's peak is the peak so far)")
    steps.run("interpreter start", lambda: None)

    def imports() -> None:
        import torch  # noqa: F401  (what most of the interpreter's memory is)

        import llama32_1b_inference  # noqa: F401
        import verify.our_runner  # noqa: F401

    steps.run("imports (torch, runtime)", imports)
    args = _parser().parse_args(argv)
    from bench.plan import FULL, prompt_ids
    from bench.protocol import measure, measure_depth
    from llama_runtime.engine.kv_cache import kv_cache_bytes
    from llama32_1b_inference import build_session
    from llama_runtime.checkpoints.resolve import resolve_checkpoint
    from verify.our_runner import OurRunner

    plan = FULL
    buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None
    resolved = resolve_checkpoint(args.model, quant=args.quant)
    if args.depth:
        short = min(plan.depths[0], args.depth)
        lengths, max_context = tuple(sorted({short, args.depth})), args.depth + plan.depth_decode
    else:
        lengths, max_context = plan.prompt_lengths, plan.max_context
    prompts = prompt_ids(resolved.folder, resolved.config, lengths)
    session = steps.run("build_session (load, preload)",
                        lambda: build_session(resolved, device=args.device, max_context=max_context,
                                              log=lambda _: None, quant=args.quant, buckets=buckets,
                                              decode=args.decode))
    runner = OurRunner(session)
    log(f"kernel cache: {session.kc.stats}")
    depth = None
    if args.depth:
        peaks = {}
        for n in lengths:         # VmHWM after each: the process's peak up to that depth
            steps.run(f"prefill {n} and {plan.depth_decode} decode steps",
                      lambda: measure_depth(runner, prompts[n], plan.depth_decode))
            peaks[n] = steps.peak
        depth = depth_memory(peaks[short], peaks[args.depth], session.kc.resident_bytes()["static"],
                             kv_cache_bytes(resolved.config, 1), short + plan.depth_decode,
                             args.depth + plan.depth_decode)
    for n in sorted(prompts) if not args.depth else ():
        # The bench's sequence for this length: warm-up and timed runs, the decode steps after the
        # decode prompt's first runs (a decode length of -1 matches no prompt: no decode).
        decode_length = plan.decode_length if n == plan.decode_length else -1
        label = f"prefill {n}" + (" and its decode steps" if decode_length == n else "")
        steps.run(label, lambda: measure(runner, {n: prompts[n]}, decode_length, plan.n_decode, plan.runs,
                                         plan.warmup, plan.short_runs, plan.short_limit))
    buffers = buffer_breakdown(session.kc)
    log("")
    log(f"peak (VmHWM over the run): {steps.peak / GIB:.3f} GiB")
    log(f"KV cache: {session.model.kv.nbytes / MIB:.1f} MiB allocated ({session.model.kv.max_seq} positions)")
    if depth:
        log(f"at {depth['deep_positions']} positions: peak {depth['peak_deep_bytes'] / GIB:.3f} GiB against weights "
            f"{depth['weight_bytes'] / GIB:.3f} + KV written {depth['kv_deep_bytes'] / GIB:.3f} + overhead at "
            f"{depth['short_positions']} positions {depth['overhead_bytes'] / GIB:.3f} = "
            f"{depth['expected_bytes'] / GIB:.3f} GiB: {depth['ratio']:.3f}x")
    for k, v in buffers.items():
        log(f"  {k:<44} {v / MIB:9.1f} MiB")
    mappings = resident_by_mapping()
    log("largest resident mappings at the end:")
    for where, nbytes in mappings:
        log(f"  {where:<60} {nbytes / MIB:9.1f} MiB")
    result = {"model": args.model, "quant": args.quant, "device": session.device.name, "peak_bytes": steps.peak,
              "steps": steps.rows, "buffers": buffers, "kv_cache_bytes": session.model.kv.nbytes,
              "mappings": dict(mappings), **({"depth": depth} if depth else {})}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"peak_gib": round(steps.peak / GIB, 3), "quant": args.quant,
                      **({"depth_ratio": round(depth["ratio"], 3)} if depth else {})}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
