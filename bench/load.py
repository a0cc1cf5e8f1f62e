"""Under load: the same TTFT and decode while processes the bench starts hold cores busy.

A laptop is never idle. Here a child measures as in the rounds (TTFT of the decode-length
prompt, then the decode steps after it) while `busy` single-threaded loops, started by the
child after its runtime has loaded and stopped when it has measured, compete for the cores:
one, and on machines with four CPUs or more, half of them. Ours runs as deployed (its team
sized to the free cores, `cpu_kernels.threads`); its llama.cpp peer (the same one the depth
sweep compares with, `bench.depth.depth_peer`) with its default threads, one per CPU. Our
decode on one thread on the idle machine is measured in the same rounds: the rate a busy
machine should not push ours far below. The runtimes take turns round by round, load by load.

The report also gives the share of a core each busy loop got: a runtime that takes the cores
from the work that owns them is not what "fast under load" means.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from bench.depth import depth_peer
from bench.plan import Plan
from bench.protocol import BUSY
from bench.summary import OURS, Target, median, ratio

LOAD = "under_load"          # the key of a model's raw results under load, beside its runtimes'
ONE_THREAD = f"{OURS}, 1 thread, idle"
DECODE_OWN_TARGET = 0.8      # ours under load ÷ ours on one thread, idle: at least
DECODE_PEER_TARGET = 1.2     # ours ÷ llama.cpp, both under the same load: at least
TTFT_PEER_TARGET = 1.0       # ours ÷ llama.cpp TTFT under the same load: at most


def loads(cpus: int | None = None) -> list[int]:
    """Cores held busy: one; and half of them where that is more than one."""
    cpus = cpus or len(os.sched_getaffinity(0))
    return [1] + ([cpus // 2] if cpus // 2 > 1 else [])


def bench_under_load(model: str, plan: Plan, sides: list, raw: dict[str, dict], base: dict, work: Path,
                     run_side: Callable[..., dict], log) -> dict:
    """Raw results by load and runtime (each a list of rounds), and ours on one idle thread."""
    peer, why = depth_peer(plan, raw)
    by_name = {name: (module, extra, python) for name, module, extra, python in sides}
    if peer not in by_name:
        peer = None
    job = {**base, "prompts": {str(plan.decode_length): base["prompts"][str(plan.decode_length)]}, "runs": 1}
    out: dict = {"peer": peer, "peer_reason": why, "loads": {}, "idle_one_thread": []}
    chosen = [name for name in (OURS, peer) if name]
    for r in range(plan.load_rounds):
        module, extra, python = by_name[OURS]
        log(f"[bench] {model}: {ONE_THREAD} (round {r + 1} of {plan.load_rounds}) ...")
        out["idle_one_thread"].append(run_side(module, {**job, **extra, "threads": 1},
                                               work / model / "load" / f"one-thread-round{r + 1}", python, log))
        for busy in loads():
            for name in chosen:
                module, extra, python = by_name[name]
                log(f"[bench] {model}: {name} with {busy} core(s) busy (round {r + 1} of {plan.load_rounds}) ...")
                result = run_side(module, {**job, **extra, BUSY: busy},
                                  work / model / "load" / f"{name.replace(' ', '-')}-{busy}-round{r + 1}", python, log)
                out["loads"].setdefault(str(busy), {}).setdefault(name, []).append(result)
    return out


def _medians(runs: list[dict], decode_length: int) -> dict:
    ok = [r for r in runs if not r.get("error")]
    ttft = [t for r in ok for t in r.get("ttft_s", {}).get(str(decode_length), [])]
    held = [r["busy"]["held_cores"] for r in ok if r.get("busy")]
    out = {"ttft_s": median(ttft), "decode_tok_s": median([d for r in ok for d in r.get("decode_tok_s", [])]),
           "busy_held_cores": median(held), "runs": len(ok)}
    threads = [r["info"].get("threads") for r in ok if r.get("info", {}).get("threads")]
    if threads:
        out["threads"] = threads[-1]
    errors = [r["error"] for r in runs if r.get("error")]
    if errors:
        out["error"] = errors[0].splitlines()[0]
    return out


def summarize_load(raw: dict, plan: Plan) -> dict:
    """Medians, ratios and targets of `bench_under_load`'s runs."""
    peer = raw["peer"]
    one = _medians(raw["idle_one_thread"], plan.decode_length)
    rows, targets = {}, []
    for busy, sides in raw["loads"].items():
        o = _medians(sides.get(OURS, []), plan.decode_length)
        p = _medians(sides.get(peer, []), plan.decode_length) if peer else {}
        rat = {"decode_vs_own_one_thread": ratio(o.get("decode_tok_s"), one.get("decode_tok_s")),
               "decode_vs_peer": ratio(o.get("decode_tok_s"), p.get("decode_tok_s")),
               "ttft_vs_peer": ratio(o.get("ttft_s"), p.get("ttft_s"))}
        rows[busy] = {"runtimes": {OURS: o, **({peer: p} if peer else {})}, "ratios": rat}
        row = f"load@{busy}"
        targets += [
            Target(f"decode, {busy} core(s) busy ≥ {DECODE_OWN_TARGET}× ours on one idle thread", row, ">=",
                   DECODE_OWN_TARGET, rat["decode_vs_own_one_thread"]),
            Target(f"decode, {busy} core(s) busy ≥ {DECODE_PEER_TARGET}× {peer} under the same load", row, ">=",
                   DECODE_PEER_TARGET, rat["decode_vs_peer"]),
            Target(f"TTFT, {busy} core(s) busy ≤ {TTFT_PEER_TARGET}× {peer} under the same load", row, "<=",
                   TTFT_PEER_TARGET, rat["ttft_vs_peer"])]
    return {"peer": peer, "peer_reason": raw.get("peer_reason"), "prompt_tokens": plan.decode_length,
            "n_decode": plan.n_decode, "rounds": plan.load_rounds, "one_thread_idle": one, "by_load": rows,
            "targets": [t.to_dict() for t in targets]}
