"""One bench run: bandwidth, then for each model every runtime in its own child, then the report.

Children run one after another, never side by side: each has the whole machine (both cores,
all the memory bandwidth) while it is timed, and its peak memory is its own. The runtimes take
turns over the plan's rounds (one child per runtime per round) and their rounds are merged, so
a drift of the host's bandwidth falls on all of them alike. Decode is then timed once more in
short alternating bursts (`bench.turns`), which pairs each runtime's decode with its peers'
within seconds. Last, for each model, decode at depth (`bench_depths`): our runtime and its
llama.cpp peer after prompts of 1K to 32K positions. A runtime that cannot run (llama.cpp not
built, a crash) becomes a note and empty cells, never a lost bench.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import BenchError
from bench.bandwidth import Bandwidth, Stream, measure_bandwidth
from bench.bandwidth import summarize as summarize_bandwidth
from bench.bound import decode_call_bytes
from bench.depth import depth_peer, merge_depth_rounds, plot_depths, summarize_depths
from bench.load import LOAD, bench_under_load, summarize_load
from bench.machine import cpu_sample, describe, other_cores
from bench.plan import Plan, depth_label, prompt_ids, split_depths
from bench.protocol import (DECODE_SPLIT, DEPTH, DEPTH_WARMUP, DEPTHS, JOB_FILE, PERPLEXITY, PREPARE, PROJECT_ROOT,
                            RESULT_FILE, child_env, exit_description)
from bench.render import markdown
from bench.summary import HF, OURS, OURS_BF16, summarize_model
from bench.turns import BANDWIDTH, decode_turns
from llama_base.config import LlamaConfig
from llama_runtime.checkpoints.resolve import EMBEDDED, SHAPES, TINIES, resolve_checkpoint
from llama_runtime.engine.kv_cache import kv_cache_bytes
from npu_runtime.xrt import device as xrt_device
from verify.report import report_paths, write_report

BUSY_CORES = 0.1   # other processes' average CPU use above which a runtime's times are flagged
BANDWIDTH_SPREAD = 1.15   # max/min of the bandwidth samples above which the report says the bound is soft
CALL_PASSES = 4       # the cut bandwidth pass: the fastest of this many, alternated with as many whole ones
SIDE_TIMEOUT_S = 3600   # a runtime that has not finished by then is hung, not slow
DEPTH_TIMEOUT_DEPTH = 8192   # ... a depth child gets that long per this many positions of its prompt
RANDOM_WEIGHT_MODELS = SHAPES + TINIES
OURS_MODULE = "bench.side_ours"


def run_side(module: str, job: dict, workdir: Path, python: str = sys.executable,
             log: Callable[[str], None] = print, timeout_s: float = SIDE_TIMEOUT_S) -> dict:
    """Run one runtime's child on `job`; its result dict (with `error` when it failed)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / JOB_FILE).write_text(json.dumps(job))
    env = child_env()
    before = cpu_sample()
    with open(workdir / "child.log", "w") as out:
        try:
            rc = subprocess.run([python, "-m", module, str(workdir)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=PROJECT_ROOT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    result_file = workdir / RESULT_FILE
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if rc is None:
        result["error"] = f"no result after {timeout_s:.0f} s: stopped"
    elif rc != 0 and "error" not in result:
        result["error"] = exit_description(workdir, rc)
    after = cpu_sample()
    result["wall_s"] = after.at_s - before.at_s
    result["other_cores"] = other_cores(before, after)
    if result.get("error"):
        log(f"[bench]   {module}: {result['error'].splitlines()[0]}")
    return result


def merge_rounds(rounds: list[dict]) -> dict:
    """One runtime's rounds as one result: all timed runs together, the highest peak memory."""
    ok = [r for r in rounds if not r.get("error")]
    failed = [(i + 1, r["error"]) for i, r in enumerate(rounds) if r.get("error")]
    merged: dict = {"ttft_s": {}, "decode_tok_s": []}
    for r in ok:
        for n, times in r.get("ttft_s", {}).items():
            merged["ttft_s"].setdefault(n, []).extend(times)
        merged["decode_tok_s"].extend(r.get("decode_tok_s", []))
    if ok:
        merged["info"] = ok[0].get("info", {})
        loads = [r["load_s"] for r in ok if "load_s" in r]
        merged["load_s"] = min(loads) if loads else None
    peaks = [r["peak_rss_bytes"] for r in rounds if r.get("peak_rss_bytes")]
    merged["peak_rss_bytes"] = max(peaks) if peaks else None
    busy = [r["other_cores"] for r in rounds if r.get("other_cores") is not None]
    merged["other_cores"] = max(busy) if busy else None
    merged["wall_s"] = sum(r.get("wall_s", 0.0) for r in rounds)
    if failed:
        merged["error"] = "; ".join(f"round {i}: {e}" for i, e in failed)
    return merged


def _llamacpp(plan: Plan, skip: bool, rebuild: bool, notes: list[str], log, cpu_class: str):
    if skip:
        notes.append("llama.cpp skipped (--skip-llamacpp).")
        return None
    from bench.llamacpp_build import ensure_llamacpp

    try:
        return ensure_llamacpp(log, rebuild=rebuild, cpu_class=cpu_class)
    except BenchError as e:
        notes.append(f"llama.cpp not measured: {e}")
        log(f"[bench] llama.cpp unavailable: {str(e).splitlines()[0]}")
        return None


def _sides(plan: Plan, folder: Path, cfg: LlamaConfig, device: str, llamacpp, model: str, notes: list[str],
           log) -> list[tuple[str, str, dict, str]]:
    """(name, module, job extras, interpreter) of every runtime measured against our `plan.quant` weights:
    HF and llama.cpp's bf16/q8_0 for bf16; our own bf16 and llama.cpp's 4-bit types for q4nx."""
    ours = {"model": str(folder), "device": device, "decode": plan.decode}
    sides = [(OURS, OURS_MODULE, {**ours, "quant": plan.quant}, sys.executable)]
    if plan.quant == "bf16":
        sides.append((HF, "bench.side_hf", {"folder": str(folder)}, sys.executable))
    else:
        sides.append((OURS_BF16, OURS_MODULE, {**ours, "quant": "bf16"}, sys.executable))
    if llamacpp is not None:
        from bench.gguf_convert import ensure_gguf

        for outtype in plan.gguf_types:
            try:
                gguf = ensure_gguf(llamacpp, folder, cfg.vocab_size, outtype, log)
            except BenchError as e:
                notes.append(f"{model}: llama.cpp {outtype} not measured: {e}")
                continue
            sides.append((f"llama.cpp {outtype}", "bench.side_llamacpp", {"gguf": str(gguf)}, str(llamacpp.python)))
    return sides


def _prepare(model: str, sides, base: dict, work: Path, notes: list[str], log) -> dict[str, dict]:
    """Each of our runtimes built once, untimed, before any round. A first build after a change
    compiles kernel groups (the MLIR compiler's library alone is 80 MiB resident, and stays
    mapped) and makes the quantized weights' cache: neither belongs in a round's load time or
    peak memory, where the first round would carry it and the rounds' highest peak would keep it.
    Returns each one's decode step split into the device's runs and the rest (`DECODE_SPLIT`)."""
    splits = {}
    for name, module, extra, python in sides:
        if module != OURS_MODULE:
            continue
        log(f"[bench] {model}: {name}: kernel cache and weights, untimed ...")
        result = run_side(module, {**base, **extra, PREPARE: True}, work / model / name.replace(" ", "-") / "prepare",
                          python, log)
        if result.get(DECODE_SPLIT):
            splits[name] = result[DECODE_SPLIT]
        elif result.get("error"):      # the rounds will show whether the build itself fails
            notes.append(f"{model}: {name}'s untimed build and decode split failed: "
                         f"{result['error'].splitlines()[0]}")
    return splits


def _perplexity(model: str, folder: Path, cfg: LlamaConfig, plan: Plan, sides, base: dict, work: Path,
                raw: dict[str, dict], notes: list[str], log) -> None:
    """Every runtime's scores on the same chunks of real text, one untimed child each."""
    if not plan.perplexity_chunks:
        return
    if model in RANDOM_WEIGHT_MODELS:
        notes.append(f"{model}: perplexity not measured (random weights: it would be near the vocabulary size "
                     "for every runtime).")
        return
    from llama_runtime.text.tokenizer import Tokenizer
    from verify.eval_text import SOURCE, eval_chunks

    chunks = eval_chunks(Tokenizer(folder, cfg), plan.perplexity_chunks, plan.perplexity_len)
    what = f"{SOURCE}: {plan.perplexity_chunks} chunks of {plan.perplexity_len} tokens"
    for name, module, extra, python in sides:
        log(f"[bench] {model}: {name} perplexity ({what}) ...")
        r = run_side(module, {**base, **extra, PERPLEXITY: chunks}, work / model / name.replace(" ", "-") / "ppl",
                     python, log)
        raw[name][PERPLEXITY] = r.get(PERPLEXITY) or {"error": r.get("error", "no scores")}
    notes.append(f"{model}: perplexity on the {what}, each scored after BOS on its own.")


def bench_model(model: str, plan: Plan, device: str, llamacpp, work: Path, notes: list[str],
                sample_bandwidth: Callable[[str], None],
                log) -> tuple[LlamaConfig, dict[str, dict], str, list[float | None] | None]:
    """Every runtime's raw results on `model`, the bandwidth sampled again after each one; last,
    the bandwidth sampled in each decode turn (None when the turns did not sample it)."""
    resolved = resolve_checkpoint(model)
    folder, cfg = resolved.folder, resolved.config
    prompts = prompt_ids(folder, cfg, plan.prompt_lengths)
    base = {"prompts": {str(n): ids for n, ids in prompts.items()}, "decode_length": plan.decode_length,
            "n_decode": plan.n_decode, "runs": plan.runs, "short_runs": plan.short_runs,
            "short_limit": plan.short_limit, "warmup": plan.warmup, "max_context": plan.max_context}
    sides = _sides(plan, folder, cfg, device, llamacpp, model, notes, log)
    splits = _prepare(model, sides, base, work, notes, log)
    rounds: dict[str, list[dict]] = {name: [] for name, *_ in sides}
    for r in range(plan.rounds):
        for name, module, extra, python in sides:
            log(f"[bench] {model}: {name} (round {r + 1} of {plan.rounds}) ...")
            result = run_side(module, {**base, **extra}, work / model / name.replace(" ", "-") / f"round{r + 1}",
                              python, log)
            rounds[name].append(result)
            compiled = result.get("info", {}).get("kernels_compiled")
            if compiled:
                notes.append(f"{model}: {name} compiled {compiled} kernel groups in round {r + 1}: its load time "
                             "and peak memory include the MLIR compiler.")
            busy = result["other_cores"]
            if busy is not None and busy > BUSY_CORES:
                notes.append(f"{model}: while {name} ran (round {r + 1}), other processes used {busy:.2f} cores "
                             "on average: its times may be slow.")
            sample_bandwidth(f"{model} {name} round {r + 1}")
    raw = {name: merge_rounds(results) for name, results in rounds.items()}
    for name, split in splits.items():
        raw[name][DECODE_SPLIT] = split
    turn_bandwidth = None
    if plan.turns:
        peaks = {name: r["peak_rss_bytes"] for name, r in raw.items() if r.get("peak_rss_bytes")}
        jobs = [(name, module, {**base, **extra}, python) for name, module, extra, python in sides]
        rates = decode_turns(model, jobs, plan.turns, plan.turn_steps, work / model, child_env(), PROJECT_ROOT, notes,
                             log, peaks, bandwidth_bytes=plan.bandwidth_bytes)
        turn_bandwidth = rates.pop(BANDWIDTH, None)
        for name, series in rates.items():
            raw[name]["decode_turns_tok_s"] = series
        sample_bandwidth(f"{model} decode turns")
    if plan.load_rounds:
        raw[LOAD] = bench_under_load(model, plan, sides, raw, base, work, run_side, log)
        sample_bandwidth(f"{model} under load")
    _perplexity(model, folder, cfg, plan, sides, base, work, raw, notes, log)
    return cfg, raw, str(folder), turn_bandwidth


def bench_depths(model: str, plan: Plan, device: str, llamacpp, work: Path, notes: list[str], log,
                 raw: dict[str, dict]) -> dict:
    """Decode at depth on `model`: for each depth it holds, every runtime's child of each round
    (ours, then its llama.cpp peer, `bench.depth.depth_peer`), the runtimes taking turns depth
    by depth; `raw` is the model's rounds, which name the fastest 4-bit peer. Returns the
    merged runs by runtime and depth, with the depths skipped and why."""
    resolved = resolve_checkpoint(model)
    folder, cfg = resolved.folder, resolved.config
    kept, skipped = split_depths(plan, cfg, model)
    out: dict = {"kept": list(kept), "skipped": {str(d): why for d, why in skipped.items()}, "runs": {},
                 "kv_bytes_per_position": kv_cache_bytes(cfg, 1), "peer": None, "peer_reason": None}
    for d, why in skipped.items():
        log(f"[bench] {model}: depth {depth_label(d)} skipped: {why}")
    if not kept:
        return out
    peer, out["peer_reason"] = depth_peer(plan, raw)
    sides = {name: (module, extra, python)
             for name, module, extra, python in _sides(plan, folder, cfg, device, llamacpp, model, [], log)}
    if peer not in sides:        # its file did not convert this time: the note of the rounds says why
        peer = None
    out["peer"] = peer
    chosen = [(name, *sides[name]) for name in (OURS, peer) if name]
    ids = prompt_ids(folder, cfg, kept)
    # Ours holds the deepest depth in every child (its KV pages are committed as they are
    # written, and the same buckets serve every depth); llama.cpp's context is each child's own.
    ours_ctx = kept[-1] + plan.depth_decode
    out["max_context"] = {OURS: ours_ctx, **({peer: "each depth + its decode steps"} if peer else {})}
    base = {"n_decode": plan.depth_decode, "runs": 1, "warmup": 0,
            DEPTH_WARMUP: [plan.depth_warmup_tokens, plan.depth_warmup_steps]}
    module, extra, python = sides[OURS]
    log(f"[bench] {model}: {OURS}: kernel groups of the depth sweep, untimed ...")
    prep = run_side(module, {**extra, **base, "prompts": {}, "decode_length": 0, "max_context": ours_ctx,
                             PREPARE: True, DEPTHS: list(kept)}, work / model / "depth" / OURS / "prepare", python, log)
    if prep.get("error"):
        notes.append(f"{model}: {OURS}'s untimed build for the depth sweep failed: {prep['error'].splitlines()[0]}")
    rounds: dict[str, dict[int, list[dict]]] = {name: {d: [] for d in kept} for name, *_ in chosen}
    try:
        _depth_rounds(model, plan, kept, chosen, ids, base, ours_ctx, rounds, work, notes, log)
    except KeyboardInterrupt:       # an hour's sweep: what finished is kept and reported
        done = min(len(v) for by_depth in rounds.values() for v in by_depth.values())
        notes.append(f"{model}: the depth sweep was interrupted (Ctrl-C) after {done} whole round(s) of "
                     f"{plan.depth_rounds}: its figures are the medians of the runs that finished.")
        out["interrupted"] = True
    out["runs"] = {name: {str(d): merge_depth_rounds(results) for d, results in by_depth.items() if results}
                   for name, by_depth in rounds.items()}
    return out


def _depth_rounds(model: str, plan: Plan, kept, chosen, ids, base: dict, ours_ctx: int,
                  rounds: dict[str, dict[int, list[dict]]], work: Path, notes: list[str], log) -> None:
    """The sweep's children, round by round, depth by depth, the runtimes in turn: each result
    into `rounds` as it comes, so an interrupted sweep keeps what finished."""
    for r in range(plan.depth_rounds):
        for d in kept:
            for name, module, extra, python in chosen:
                log(f"[bench] {model}: {name} at depth {depth_label(d)} (round {r + 1} of {plan.depth_rounds}) ...")
                job = {**extra, **base, "prompts": {str(d): ids[d]}, "decode_length": d, DEPTH: d,
                       "max_context": ours_ctx if name == OURS else d + plan.depth_decode}
                result = run_side(module, job, work / model / "depth" / name.replace(" ", "-") / f"{d}-round{r + 1}",
                                  python, log, timeout_s=SIDE_TIMEOUT_S * max(1.0, d / DEPTH_TIMEOUT_DEPTH))
                rounds[name][d].append(result)
                if result.get("info", {}).get("kernels_compiled"):
                    notes.append(f"{model}: {name} compiled kernel groups at depth {depth_label(d)} in round "
                                 f"{r + 1}: its load or TTFT there includes the MLIR compiler.")
                busy = result["other_cores"]
                if busy is not None and busy > BUSY_CORES:
                    notes.append(f"{model}: while {name} ran at depth {depth_label(d)} (round {r + 1}), other "
                                 f"processes used {busy:.2f} cores on average: its times may be slow.")


def decode_calls(measured: list, plan: Plan, device: str, log: Callable[[str], None]) -> dict[str, dict]:
    """Per model, the bandwidth pass cut into our decode step's GEMV calls on the simulated
    device (`Stream.sample_calls`), after every runtime has finished: the share of the bound
    that starting and ending that many calls costs before any kernel's own work. On the NPU
    the calls are the device's, which this cannot stand in for."""
    if device == "npu" or (device == "auto" and xrt_device.probe()[0]):
        return {}
    stream, out = Stream(plan.bandwidth_bytes), {}
    for model, cfg, *_ in measured:
        try:
            out[model] = stream.sample_calls(decode_call_bytes(cfg, plan.quant), CALL_PASSES)
        except ValueError as e:        # a call larger than the matrix (a short run's small one)
            out[model] = {"error": str(e)}
            continue
        log(f"[bench] {model}: the bandwidth pass cut into {out[model]['calls']} decode calls read "
            f"{out[model]['ratio']:.1%} of its whole rate")
    return out


def run_bench(models: list[str], plan: Plan, device: str = "auto", skip_llamacpp: bool = False,
              rebuild_llamacpp: bool = False, log: Callable[[str], None] = print,
              cpu_class: str = "native") -> tuple[dict, str, tuple[Path, Path]]:
    """`cpu_class` other than native: the children must already run with `CLASS_ENV[cpu_class]`
    (the CLI sets it), and llama.cpp is built for that class's flags."""
    notes: list[str] = list(plan.notes)
    data: dict = {"created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": device,
                  "machine": describe(cpu_class), "plan": plan.to_dict(), "models": [], "notes": notes}
    samples: list[tuple[str, Bandwidth]] = []

    def sample_bandwidth(after: str) -> None:
        samples.append((after, measure_bandwidth(plan.bandwidth_bytes)))

    log(f"[bench] memory bandwidth over {plan.bandwidth_bytes / (1 << 30):.2f} GiB ...")
    sample_bandwidth("start")
    log(f"[bench] memory bandwidth {samples[0][1].bytes_per_s / 1e9:.1f} GB/s ({samples[0][1].method})")
    llamacpp = _llamacpp(plan, skip_llamacpp, rebuild_llamacpp, notes, log, cpu_class)
    if llamacpp is not None:
        data["llamacpp_build"] = {"version": llamacpp.version, "cmake_args": list(llamacpp.cmake_args)}
    measured = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for model in models:
            if plan.depth_only:
                depth = bench_depths(model, plan, device, llamacpp, Path(tmp), notes, log, {})
                data["models"].append({"model": model, "quant": plan.quant, "depth_only": True,
                                       "depth": summarize_depths(depth, plan)})
            else:
                cfg, raw, folder, turn_bandwidth = bench_model(model, plan, device, llamacpp, Path(tmp), notes,
                                                               sample_bandwidth, log)
                depth = bench_depths(model, plan, device, llamacpp, Path(tmp), notes, log, raw) if plan.depths else None
                measured.append((model, cfg, raw, folder, turn_bandwidth, depth))
            if depth is not None and depth.get("interrupted"):
                left = models[models.index(model) + 1:]
                if left:
                    notes.append(f"not measured after the interruption: {', '.join(left)}.")
                break
        if plan.depth_only:
            sample_bandwidth("the depth sweep")
    bw = data["bandwidth"] = summarize_bandwidth(samples)
    if bw["max_bytes_per_s"] > BANDWIDTH_SPREAD * bw["min_bytes_per_s"]:
        notes.append(f"memory bandwidth varied from {bw['min_bytes_per_s'] / 1e9:.1f} to {bw['max_bytes_per_s'] / 1e9:.1f} "
                     "GB/s during the run (a shared host): the bound and the % of it are approximate.")
    calls = decode_calls(measured, plan, device, log)
    for model, cfg, raw, folder, turn_bandwidth, depth in measured:
        load = raw.pop(LOAD, None)
        summary = summarize_model(model, cfg, model == EMBEDDED, plan.prompt_lengths, plan.max_context, raw,
                                  bw["bytes_per_s"], quant=plan.quant, turn_bandwidth=turn_bandwidth,
                                  call_structure=calls.get(model))
        data["models"].append({**summary, "folder": folder,
                               **({"depth": summarize_depths(depth, plan)} if depth is not None else {}),
                               **({"load": summarize_load(load, plan)} if load is not None else {})})
        for name in summary["bound_readers"]:
            frac = summary["bound_fraction"].get(name)
            if frac is not None and frac > 1:
                rate = summary["runtimes"][name]["decode_tok_s"] * summary["decode_bytes_per_token"]
                notes.append(f"{model}: {name} decoded at {frac:.0%} of the bound, reading {plan.quant} weights at "
                             f"{rate / 1e9:.1f} GB/s: faster than the median bandwidth sample, so the bound is a "
                             "reference here, not a ceiling.")
    paths = report_paths("bench")
    data["depth_plot"] = _depth_plot(data, paths[0].with_name(f"{paths[0].stem}-depth.png"), notes)
    md = markdown(data)
    return data, md, write_report("bench", data, md, paths)


def _depth_plot(data: dict, path: Path, notes: list[str]) -> str | None:
    """The decode-at-depth plot beside the reports; its file name (the Markdown links it), or
    None with a note where it could not be drawn."""
    try:
        return plot_depths(data["models"], path, data["machine"]) and path.name
    except ImportError as e:
        notes.append(f"decode at depth: no plot ({e}; `make install` installs matplotlib).")
    except Exception as e:      # a plot is not worth the measurements of the whole run
        notes.append(f"decode at depth: no plot ({type(e).__name__}: {e}).")
    return None
