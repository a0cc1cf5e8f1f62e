"""The bench report for people: one table per model, the bandwidth and bound lines, notes."""
from __future__ import annotations

import statistics

from bench.plan import depth_label
from bench.protocol import PERPLEXITY
from bench.summary import OURS
from bench.turns import BANDWIDTH_PASSES
from verify.report import md_table

GB = 1e9
GIB = float(1 << 30)
LABELS = {"ours": "ours", "hf": "HF transformers"}


def _num(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def _target_value(t: dict) -> str:
    if t["value"] is None:
        return "—"
    if t["row"] == "load":
        return f"{t['value']:.2f} s"
    return f"{t['value']:.0%}" if t["row"].startswith("bound") else f"{t['value']:.2f}×"


def model_table(m: dict) -> str:
    sides = m["runtimes"]
    peers = [p for p in sides if p != OURS]
    lengths = sorted({n for s in sides.values() for n in s.get("ttft_s", {})})
    header = ["metric", *(LABELS.get(k, k) for k in sides), *(f"ours/{LABELS.get(p, p)}" for p in peers), "target"]
    by_row: dict[str, list[str]] = {}
    for t in m["targets"]:
        by_row.setdefault(t["row"], []).append(f"{t['name']}: {_target_value(t)} **{t['status']}**")

    def row(label: str, key: str, values: list[str], ratio_key: str | None) -> list[str]:
        rs = [_num(m["ratios"][p].get(ratio_key), ".2f") + "×" if ratio_key and m["ratios"][p].get(ratio_key) is not None
              else "—" for p in peers]
        return [label, *values, *rs, "; ".join(by_row.get(key, []))]

    rows = [row(f"TTFT @{n} tokens (s)", f"ttft@{n}", [_num(s.get("ttft_s", {}).get(n), ".3f") for s in sides.values()],
                f"ttft@{n}") for n in lengths]
    turns = any(s.get("runs", {}).get("decode_turns_tok_s") for s in sides.values())
    rows.append(row("decode, in turns (tokens/s)" if turns else "decode (tokens/s)", "decode",
                    [_num(s.get("decode_tok_s"), ".2f") for s in sides.values()], "decode"))
    if turns:
        rows.append(row("decode, in rounds (tokens/s)", "decode_rounds",
                        [_num(s.get("decode_rounds_tok_s"), ".2f") for s in sides.values()], "decode_rounds"))
    rows.append(row(f"decode, % of the {m.get('quant', 'bf16')} bound", "bound",
                    [_num(m["bound_fraction"].get(k), ".0%") for k in sides], None))
    in_turns = m.get("bound_fraction_turns", {})
    if any(v is not None for v in in_turns.values()):
        rows.append(row("decode, % of the bound in the same turn", "bound_turns",
                        [_num(in_turns.get(k), ".0%") for k in sides], None))
    rows.append(row("load: process start to ready (s)", "load", [_num(s.get("load_s"), ".2f") for s in sides.values()],
                    "load"))
    rows.append(row("peak resident memory (GiB)", "peak_rss",
                    [_num(s["peak_rss_bytes"] / GIB if s.get("peak_rss_bytes") else None, ".2f") for s in sides.values()],
                    "peak_rss"))
    if any(PERPLEXITY in s for s in sides.values()):
        ppl = [s.get(PERPLEXITY, {}) for s in sides.values()]
        rows.append(row("perplexity", PERPLEXITY, [_num(p.get("perplexity"), ".3f") for p in ppl], PERPLEXITY))
        ref = LABELS.get(m["perplexity_reference"], m["perplexity_reference"])
        rows.append(row(f"top-1 agreement with {ref}", "agreement",
                        [_num(p.get("top1_agreement"), ".1%") for p in ppl], None))
    return md_table(header, rows)


def _short_runs(plan: dict) -> str:
    n = plan["runs"] * plan.get("short_runs", 1)
    if n <= plan["runs"]:
        return ""
    return (f" (TTFT of prompts up to {plan['short_limit']} tokens {n}× per round, "
            f"a median of {plan['rounds'] * n})")


def _turns(plan: dict) -> str:
    if not plan.get("turns"):
        return ""
    return (f" Then decode in {plan['turns']} turns: every runtime loaded at once, each decoding "
            f"{plan['turn_steps']} tokens per turn in a shuffled order, one at a time; decode rates are the "
            "medians of those bursts and decode ratios the medians of the ratios within each turn.")


def _machine(mc: dict) -> str:
    return (f"{mc['cpu']}, {mc.get('core', 'core not recorded')}, {mc['cores']} cores, "
            f"{mc['memory_bytes'] / GIB:.0f} GiB")


def _decode_mode(data: dict) -> str:
    """Our decode as asked and, where a model's runs report it, as chosen (`auto` picks one)."""
    asked = data["plan"].get("decode", "auto")
    chosen = {s.get("info", {}).get("decode") for m in data["models"] for k, s in m.get("runtimes", {}).items()
              if k.startswith(OURS)} | {(m.get("depth") or {}).get("decode") for m in data["models"]}
    chosen -= {None}
    if not chosen or chosen == {asked}:
        return f"`{asked}`"
    return f"`{asked}` → " + ", ".join(f"`{c}`" for c in sorted(chosen))


def depth_table(m: dict) -> str:
    """One row a depth the model holds: TTFT and decode of ours and its peer, ours ÷ peer, our
    peak, the targets of that depth."""
    dep = m["depth"]
    peer = dep.get("peer")
    by_row: dict[str, list[str]] = {}
    for t in dep["targets"]:
        by_row.setdefault(t["row"], []).append(f"{t['name']}: {_target_value(t)} **{t['status']}**")
    who = peer or "llama.cpp"
    header = ["depth", "TTFT ours (s)", f"TTFT {who} (s)", "TTFT ours/peer", "decode ours (tokens/s)",
              f"decode {who} (tokens/s)", "decode ours/peer", "peak ours (GiB)", "target"]
    rows = []
    for d in dep["kept"]:
        row = dep["by_depth"][str(d)]
        o, p = row["runtimes"].get(OURS, {}), row["runtimes"].get(peer, {}) if peer else {}
        rat = row["ratios"]
        peak = o.get("peak_rss_bytes")
        rows.append([depth_label(d), _num(o.get("ttft_s"), ".3f"), _num(p.get("ttft_s"), ".3f"),
                     _num(rat["ttft"], ".2f") + ("×" if rat["ttft"] is not None else ""),
                     _num(o.get("decode_tok_s"), ".2f"), _num(p.get("decode_tok_s"), ".2f"),
                     _num(rat["decode"], ".2f") + ("×" if rat["decode"] is not None else ""),
                     _num(peak / GIB if peak else None, ".3f"), "; ".join(by_row.get(f"depth@{d}", []))])
    return md_table(header, rows)


def _depth_memory(m: dict) -> str:
    mem = m["depth"]["memory"]
    (t,) = [t for t in m["depth"]["targets"] if t["row"] == "depth_memory"] or [None]
    verdict = f" {t['name']}: **{t['status']}**." if t else ""
    if mem.get("error"):
        return f"Peak memory at depth: not compared ({mem['error']}).{verdict}"
    deep, short = depth_label(mem["deep_depth"]), depth_label(mem["short_depth"])
    return (f"Peak memory at {deep}: **{mem['peak_deep_bytes'] / GIB:.3f} GiB** against weights "
            f"{mem['weight_bytes'] / GIB:.3f} + KV written {mem['kv_deep_bytes'] / GIB:.3f} ({mem['deep_positions']} "
            f"positions × {mem['kv_bytes_per_position']} bytes) + fixed overhead {mem['overhead_bytes'] / GIB:.3f} "
            f"(the peak at {short}, {mem['peak_short_bytes'] / GIB:.3f} GiB, less its weights and "
            f"{mem['kv_short_bytes'] / GIB:.3f} of KV) = {mem['expected_bytes'] / GIB:.3f} GiB: "
            f"**{mem['ratio']:.2f}×**.{verdict}")


def depth_section(data: dict) -> list[str]:
    """The decode-at-depth section: what ran on which CPU, the plot, a table per model."""
    models = [m for m in data["models"] if m.get("depth")]
    if not models:
        return []
    plan = data["plan"]
    n = plan["depth_decode"]
    lines = ["", "## Decode at depth", "",
             f"Figures from {_machine(data['machine'])}, device `{data['device']}`, our decode "
             f"{_decode_mode(data)}. For each depth a prompt of that many token ids (the plan's fixed text, "
             f"repeated; the same ids for every runtime) is prefilled, its TTFT timed, then {n} greedy decode "
             f"steps after it; each runtime and depth in a child of its own, after an untimed warm-up of "
             f"{plan['depth_warmup_tokens']} ids and {plan['depth_warmup_steps']} decode steps; the runtimes take "
             f"turns depth by depth in {plan['depth_rounds']} rounds and each figure is the median of its rounds. "
             f"Our KV cache holds the deepest depth + {n} positions in every child (committed as written), "
             f"llama.cpp's n_ctx each depth + {n}. Ratios are ours ÷ llama.cpp: decode tokens/s (above 1 is "
             "better for us), TTFT seconds (below 1 is)."]
    if data.get("depth_plot"):
        lines += ["", f"![decode tokens/s against depth]({data['depth_plot']})",
                  "", f"Plot: [{data['depth_plot']}]({data['depth_plot']})"]
    for m in models:
        dep = m["depth"]
        lines += ["", f"### {m['model']} at depth", ""]
        who = (f"ours `{m.get('quant', 'bf16')}` against {dep['peer']} ({dep['peer_reason']})" if dep.get("peer")
               else f"ours `{m.get('quant', 'bf16')}` alone ({dep.get('peer_reason') or 'llama.cpp not measured'})")
        lines.append(f"{who[0].upper()}{who[1:]}.")
        for d, why in dep["skipped"].items():
            lines.append(f"- {depth_label(int(d))} skipped: {why}.")
        if not dep["kept"]:
            continue
        lines += ["", depth_table(m), "", _depth_memory(m)]
        for d in dep["kept"]:
            for name, s in dep["by_depth"][str(d)]["runtimes"].items():
                if s.get("error"):
                    lines.append(f"\n- {LABELS.get(name, name)} at {depth_label(d)} failed: {s['error']}")
    return lines


def load_section(data: dict) -> list[str]:
    """The "Under load" section (`bench.load`): a table a model, then its targets."""
    models = [m for m in data["models"] if m.get("load")]
    if not models:
        return []
    ld = models[0]["load"]
    lines = ["", "## Under load", "",
             f"The same child measurements as the rounds (TTFT of the {ld['prompt_tokens']}-token prompt, "
             f"{ld['n_decode']} decode steps after it; medians of {ld['rounds']} rounds) while single-threaded "
             "busy loops, started by the child once its runtime has loaded, hold that many cores. Ours as "
             "deployed (its threads follow the free cores); llama.cpp with its default threads. \"Busy loops "
             "got\" is the cores the loops ran on: a runtime that takes them from their owner shows here."]
    for m in models:
        ld = m["load"]
        one = ld["one_thread_idle"]
        rows = [[busy, name, _num(s.get("ttft_s"), ".3f"), _num(s.get("decode_tok_s"), ".2f"),
                 _num(s.get("busy_held_cores"), ".2f"), s.get("threads", "")]
                for busy, row in ld["by_load"].items() for name, s in row["runtimes"].items()]
        lines += ["", f"### {m['model']} under load", "",
                  f"Ours on one thread, idle machine: decode {_num(one.get('decode_tok_s'), '.2f')} tokens/s, "
                  f"TTFT {_num(one.get('ttft_s'), '.3f')} s. Peer: {ld['peer']} ({ld['peer_reason']}).", "",
                  md_table(["cores busy", "runtime", "TTFT (s)", "decode (tokens/s)", "busy loops got (cores)",
                            "threads"], rows), "",
                  md_table(["target", "value", "status"],
                           [[t["name"], _num(t["value"], ".2f"), t["status"]] for t in ld["targets"]])]
    return lines


def markdown(data: dict) -> str:
    bw = data.get("bandwidth")
    lines = [f"# Bench {data['created']}", ""]
    mc = data["machine"]
    if data["plan"].get("depth_only"):
        lines.append(f"Machine: {_machine(mc)}; device `{data['device']}`; our weights "
                     f"`{data['plan'].get('quant', 'bf16')}`; our decode {_decode_mode(data)}; plan: decode at depth "
                     "only (`--depth-only`: no rounds, turns or perplexity).")
    else:
        lines.append(f"Machine: {_machine(mc)}; "
                     f"device `{data['device']}`; our weights `{data['plan'].get('quant', 'bf16')}`; our decode "
                     f"{_decode_mode(data)}; plan: TTFT at {', '.join(map(str, data['plan']['prompt_lengths']))} "
                     f"tokens, {data['plan']['n_decode']} decode tokens after the {data['plan']['decode_length']}-token "
                     f"prompt, median of {data['plan']['rounds'] * data['plan']['runs']} timed runs: "
                     f"{data['plan']['rounds']} rounds in which the runtimes take turns, each starting afresh and "
                     f"running every measurement {data['plan']['runs']}× after {data['plan']['warmup']} "
                     f"warm-up{_short_runs(data['plan'])}.{_turns(data['plan'])}")
    if mc.get("cpu_class", "native") != "native":
        env = ", ".join(f"{k}={v}" for k, v in mc["class_env"].items())
        lines.append(f"**Run as CPU class `{mc['cpu_class']}`** on this machine: every runtime kept off the "
                     f"instructions the class lacks ({env}; llama.cpp built without them).")
    lines.append("Ratios are ours ÷ peer: below 1 is better for us for TTFT and memory, above 1 for tokens/s.")
    lines.append("")
    if bw:
        samples = bw["samples"]
        lines.append(f"**Memory bandwidth: {bw['bytes_per_s'] / GB:.1f} GB/s** — {bw['method']} over a "
                     f"{bw['matrix_bytes'] / GIB:.2f} GiB matrix; median of {len(samples)} samples taken at the start, "
                     f"after each runtime in each round and after the decode turns (each the fastest of "
                     f"{len(samples[0]['pass_s'])} passes), range "
                     f"{bw['min_bytes_per_s'] / GB:.1f}–{bw['max_bytes_per_s'] / GB:.1f} GB/s.")
    else:
        lines.append("Memory bandwidth: not measured.")
    for m in data["models"]:
        if m.get("depth_only"):
            continue
        lines += ["", f"## {m['model']}", ""]
        per_token = m["decode_bytes_per_token"]
        if m["decode_bound_tok_s"]:
            lines.append(f"Decode bound: {per_token / GB:.3f} GB of {m.get('quant', 'bf16')} weights read per token "
                         f"(linear layers + LM head + one embedding row) ÷ bandwidth = "
                         f"{1e3 / m['decode_bound_tok_s']:.1f} ms/token = **{m['decode_bound_tok_s']:.2f} tokens/s**.")
        got = [b for b in m.get("turn_bandwidth", []) if b]
        if got:
            lines.append(f"In the decode turns the bandwidth was sampled in every turn as well (the fastest of "
                         f"{BANDWIDTH_PASSES} passes): median {statistics.median(got) / GB:.1f} GB/s, range "
                         f"{min(got) / GB:.1f}–{max(got) / GB:.1f}; each burst is held against its own turn's bound "
                         "on the row \"% of the bound in the same turn\".")
        hs = m.get("host_share")
        if hs:
            rescoring = " and, with 4-bit weights, the LM head's rescoring" if m.get("quant", "bf16") != "bf16" else ""
            lines.append(f"Our decode step outside the device's runs (host attention, KV writes, the launches' "
                         f"own work, the final norm{rescoring}; {hs['steps']} untimed steps before "
                         f"round 1, profiler on): {hs['host_s'] * 1e3:.2f} of {hs['step_s'] * 1e3:.2f} ms. "
                         f"Even with the device's runs taking exactly the bound's time, that share holds decode "
                         f"to {hs['ceiling']:.0%} of the bound at {hs['bandwidth_bytes_per_s'] / GB:.1f} GB/s.")
        calls = m.get("call_structure")
        if calls and not calls.get("error"):
            both = (f" With the host's share as well, decode can reach {calls['ceiling_with_host']:.0%} of the bound."
                    if "ceiling_with_host" in calls else "")
            lines.append(f"Our decode step makes {calls['calls']} GEMV calls on the simulated device (Q/K/V, O, gate "
                         f"and up, down a layer, then the LM head). The bandwidth pass cut into calls of the same "
                         f"sizes, alternated with whole passes (the fastest of {calls['passes']} each), read "
                         f"{calls['calls_bytes_per_s'] / GB:.1f} against {calls['whole_bytes_per_s'] / GB:.1f} GB/s: "
                         f"**{calls['ratio']:.1%}**, what starting and ending the calls costs a stream that does "
                         f"nothing else.{both}")
        if m.get("quant", "bf16") == "bf16":
            lines.append(f"Memory budget: 1.5 × (weights {m['weight_bytes'] / GIB:.2f} GiB + KV cache "
                         f"{m['kv_cache_bytes'] / GIB:.2f} GiB) = "
                         f"{1.5 * (m['weight_bytes'] + m['kv_cache_bytes']) / GIB:.2f} GiB.")
        lines += ["", model_table(m)]
        est = m.get("npu_estimate")
        if est and not est.get("error") and est.get("decode") == "fused":
            lines += ["", fused_estimate(est)]
        elif est and not est.get("error"):
            ttft = ", ".join(f"TTFT@{n} {v * 1e3:.0f} ms" for n, v in est["ttft_s"].items())
            lines.append(f"\nNPU estimate (cost model, not a measurement): {ttft}, decode "
                         f"{est['decode_tok_s']:.1f} tok/s on NPU2 ({est['calibration']}; docs/profile.md gives its error).")
        for name, s in m["runtimes"].items():
            if s.get("error"):
                lines.append(f"\n- {LABELS.get(name, name)} failed: {s['error']}")
    lines += depth_section(data)
    lines += load_section(data)
    if data.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines)


def fused_estimate(est: dict) -> str:
    """The NPU estimate of a fused decode (`fused_report.bench_estimate`): its TTFT, and its decode
    at each context beside the bytes bound, the layers design and the published anchors."""
    ttft = ", ".join(f"TTFT@{n} {v * 1e3:.0f} ms" for n, v in est["ttft_s"].items())
    anchors = est.get("anchors") is not None
    targets = any(d["target"] is not None for d in est["depths"])
    cols = (["context", "fused (tok/s)", "bytes bound", "layers design"] + (["upstream", "FastFlowLM"] if anchors else [])
            + (["target"] if targets else []))
    rows = [f"NPU estimate of the fused decode (cost model, not a measurement): {ttft}; {est['calibration']}.", "",
            "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for d in est["depths"]:
        cells = [str(d["depth"]), f"{d['tok_s']:.1f}", f"{d['bound_tok_s']:.1f}", f"{d['layers_tok_s']:.1f}"]
        if anchors:
            cells += [f"{d['upstream_tok_s']:.2f}" if d.get("upstream_tok_s") else "",
                      f"{d['fastflowlm_tok_s']:.1f}" if d.get("fastflowlm_tok_s") else ""]
        if targets and d["target"] is None:
            cells.append("")
        elif targets:
            met = d["tok_s"] >= d["target"]
            cells.append(f"≥ {d['target']:g}: " + ("met" if met else "missed" + (" (the bytes bound is below it)"
                                                                                  if d["bound_blocks"] else "")))
        rows.append("| " + " | ".join(cells) + " |")
    if anchors:
        rows += ["", est["anchors"]]
    return "\n".join(rows)
