"""Decode at depth, from raw runs to the verdict: medians per depth, ratios, memory, targets, the plot.

The sweep itself (`bench.run.bench_depths`) times, for each depth the model holds, a prompt of
that many positions (TTFT) and the decode steps after it, our runtime and one llama.cpp peer of
the same weights class taking turns; each (runtime, depth, round) is a child of its own. Here
each figure is the median of its rounds and each ratio ours ÷ peer of the medians, as the
rounds' figures of the rest of the bench: decode tokens/s ours ÷ theirs (above 1 is better for
us), TTFT seconds ours ÷ theirs (below 1 is).

Memory: our peak at the deepest depth against the weights, plus the KV the deepest run wrote
(positions × bytes a position), plus the fixed overhead of the shallowest depth (its peak less
its weights and the KV it wrote): everything that grows with the context but the KV cache
shows as a ratio above 1 (`bench.peak_memory.depth_memory`).
"""
from __future__ import annotations

from pathlib import Path

from bench.peak_memory import depth_memory
from bench.plan import GGUF_TYPES, Plan, depth_label
from bench.summary import LLAMACPP, OURS, Target, median, ratio, side_summary

DECODE_TARGET = 1.1     # ours ÷ llama.cpp decode at every depth, at least
TTFT_TARGET = 1.0       # ours ÷ llama.cpp TTFT at the plan's `depth_ttft_targets`, at most
MEMORY_TARGET = 1.2     # our peak at the deepest depth ÷ (weights + KV written + the short one's overhead)


def depth_peer(plan: Plan, raw: dict[str, dict]) -> tuple[str | None, str]:
    """The llama.cpp side the sweep measures ours against, and why that one: llama.cpp bf16
    against our bf16; against our 4-bit weights whichever of the bench's 4-bit types decoded
    fastest in this run's rounds and turns (the first measured one where none has a rate, the
    one converted in a depth-only run). None where llama.cpp was not measured."""
    if plan.quant == "bf16":
        name = f"{LLAMACPP} bf16"
        if name in raw or plan.depth_only:
            return name, "the same weights class, bf16"
        return None, "llama.cpp not measured"
    four_bit = [f"{LLAMACPP} {t}" for t in plan.gguf_types if t in GGUF_TYPES["q4nx"]]
    if plan.depth_only:
        return (four_bit[0], f"a depth-only run times no rounds to rank the 4-bit types by: "
                             f"{four_bit[0].split()[-1]}, the one it converts") if four_bit else (None, "no 4-bit type")
    present = [n for n in four_bit if n in raw]
    if not present:
        return None, "llama.cpp not measured"
    rates = {n: side_summary(raw[n]).get("decode_tok_s") for n in present}
    measured = {n: r for n, r in rates.items() if r}
    if not measured:
        return present[0], "no 4-bit type's decode was measured in the rounds: the first of them"
    best = max(measured, key=measured.get)
    others = ", ".join(f"{n.split()[-1]} {r:.2f}" for n, r in measured.items())
    return best, f"the fastest 4-bit type in this run's decode (tokens/s: {others})"


def merge_depth_rounds(rounds: list[dict]) -> dict:
    """One runtime's rounds at one depth: every timed figure, the peaks of the rounds that ran."""
    ok = [r for r in rounds if not r.get("error")]
    merged: dict = {"ttft_s": [r["ttft_s"] for r in ok if r.get("ttft_s") is not None],
                    "decode_tok_s": [r["decode_tok_s"] for r in ok if r.get("decode_tok_s") is not None],
                    "peak_rss_bytes": [r["peak_rss_bytes"] for r in ok if r.get("peak_rss_bytes")],
                    "load_s": [r["load_s"] for r in ok if r.get("load_s") is not None],
                    "other_cores": max((r["other_cores"] for r in rounds if r.get("other_cores") is not None),
                                       default=None),
                    "wall_s": sum(r.get("wall_s", 0.0) for r in rounds),
                    "info": ok[0].get("info", {}) if ok else {}}
    failed = [(i + 1, r["error"]) for i, r in enumerate(rounds) if r.get("error")]
    if failed:
        merged["error"] = "; ".join(f"round {i}: {e.splitlines()[0]}" for i, e in failed)
    return merged


def _side(merged: dict) -> dict:
    peaks = merged.get("peak_rss_bytes") or []
    out = {"ttft_s": median(merged.get("ttft_s")), "decode_tok_s": median(merged.get("decode_tok_s")),
           "peak_rss_bytes": max(peaks) if peaks else None, "other_cores": merged.get("other_cores"),
           "runs": {k: merged.get(k, []) for k in ("ttft_s", "decode_tok_s", "peak_rss_bytes", "load_s")}}
    if merged.get("error"):
        out["error"] = merged["error"]
    return out


def memory_at_depth(by_depth: dict[str, dict], kept: list[int], n_decode: int, kv_bytes_per_position: int,
                    weights: int | None) -> dict:
    """Our peak at the deepest depth against weights + its KV written + the shallowest's overhead."""
    if len(kept) < 2:
        return {"error": "one depth measured: no shorter context to take the fixed overhead from"}
    short, deep = kept[0], kept[-1]
    peaks = [by_depth[str(d)]["runtimes"].get(OURS, {}).get("peak_rss_bytes") for d in (short, deep)]
    if None in peaks or weights is None:
        return {"error": "our peak memory was not measured at both depths"}
    return {"short_depth": short, "deep_depth": deep,
            **depth_memory(peaks[0], peaks[1], weights, kv_bytes_per_position, short + n_decode, deep + n_decode)}


def depth_targets(by_depth: dict[str, dict], kept: list[int], ttft_depths: tuple[int, ...], peer: str | None,
                  memory: dict) -> list[Target]:
    """Decode ≥ 1.1× the peer at every depth measured, TTFT ≤ 1.0× at the plan's TTFT depths,
    our peak within 1.2× of weights + KV written + overhead; n/a where a figure is missing."""
    who = peer or LLAMACPP
    out = []
    for d in kept:
        rat = by_depth[str(d)]["ratios"]
        out.append(Target(f"decode @{depth_label(d)} ≥ {DECODE_TARGET:.1f}× {who}", f"depth@{d}", ">=",
                          DECODE_TARGET, rat["decode"]))
        if d in ttft_depths:
            out.append(Target(f"TTFT @{depth_label(d)} ≤ {TTFT_TARGET:.1f}× {who}", f"depth@{d}", "<=", TTFT_TARGET,
                              rat["ttft"]))
    if kept:
        short, deep = depth_label(kept[0]), depth_label(kept[-1])
        out.append(Target(f"peak memory @{deep} ≤ {MEMORY_TARGET:.1f}× (weights + KV written + overhead at {short})",
                          "depth_memory", "<=", MEMORY_TARGET, memory.get("ratio")))
    return out


def summarize_depths(raw: dict, plan: Plan) -> dict:
    """`bench.run.bench_depths`'s raw results as the report's figures, ratios and targets."""
    kept, peer = raw["kept"], raw.get("peer")
    by_depth: dict[str, dict] = {}
    for d in kept:
        sides = {name: _side(runs[str(d)]) for name, runs in raw["runs"].items() if str(d) in runs}
        o, p = sides.get(OURS, {}), sides.get(peer, {}) if peer else {}
        by_depth[str(d)] = {"runtimes": sides,
                            "ratios": {"ttft": ratio(o.get("ttft_s"), p.get("ttft_s")),
                                       "decode": ratio(o.get("decode_tok_s"), p.get("decode_tok_s"))}}
    info = next((r["info"] for r in raw["runs"].get(OURS, {}).values() if r.get("info")), {})
    weights = (info.get("resident_bytes") or {}).get("static")
    memory = memory_at_depth(by_depth, kept, plan.depth_decode, raw["kv_bytes_per_position"], weights)
    targets = depth_targets(by_depth, kept, plan.depth_ttft_targets, peer, memory)
    return {"depths": list(plan.depths), "kept": kept, "skipped": raw["skipped"], "peer": peer,
            "peer_reason": raw.get("peer_reason"), "n_decode": plan.depth_decode, "max_context": raw.get("max_context"),
            "decode": info.get("decode"), "by_depth": by_depth, "memory": memory,
            "targets": [t.to_dict() for t in targets]}


def plot_depths(models: list[dict], path: Path, machine: dict) -> Path | None:
    """Decode tokens/s against depth, a panel per model, a line per runtime, as a PNG at `path`
    (matplotlib's Agg canvas: no display needed). None where no model has a decode figure."""
    def measured(m: dict) -> bool:
        rows = (m.get("depth") or {}).get("by_depth", {}).values()
        return any(s.get("decode_tok_s") for row in rows for s in row["runtimes"].values())

    panels = [m for m in models if measured(m)]
    if not panels:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * len(panels), 4.2))
    FigureCanvasAgg(fig)
    for ax, m in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        dep = m["depth"]
        kept = dep["kept"]
        names = list(dict.fromkeys(n for d in kept for n in dep["by_depth"][str(d)]["runtimes"]))
        for name in names:
            points = [(d, dep["by_depth"][str(d)]["runtimes"].get(name, {}).get("decode_tok_s")) for d in kept]
            points = [(d, v) for d, v in points if v is not None]
            if points:
                label = f"ours {m.get('quant', 'bf16')}" if name == OURS else name
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(kept, [depth_label(d) for d in kept])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("context depth (positions before the decode steps)")
        ax.set_ylabel("decode (tokens/s)")
        ax.set_title(f"{m['model']}, {dep['n_decode']} decode steps after the prompt", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"Decode at depth: {machine.get('cpu')}, {machine.get('core', 'core not recorded')}, "
                 f"{machine.get('cores')} cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return path
