"""From raw runs to the bench's verdict: medians, ratios ours/peer, the decode bound, targets.

Ratios are always ours ÷ peer, whatever the metric, so one rule reads them: for TTFT, memory
and perplexity below 1 is better for us, for tokens/s above 1 is. "ours" is our runtime in the
bench's weight format; in a 4-bit bench "ours bf16" is the same runtime on bf16 weights, a peer
like the others. The decode ratio is paired where the
decode turns ran (the median of the ratios within each turn, `bench.turns`); the ratio of the
rounds' medians is kept beside it. Targets are the project's; each is
PASS or MISS, or n/a when a run did not produce the value it needs (a skipped llama.cpp, a
prompt length the quick plan leaves out), so a missing number never passes silently.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from bench.bound import decode_bound_tokens_per_s, decode_bytes_per_token, kv_cache_bytes, weight_bytes
from bench.protocol import DECODE_SPLIT, PERPLEXITY
from llama_base.config import LlamaConfig
from verify.scoring import agreement, perplexity

OURS, HF, LLAMACPP_BF16 = "ours", "hf", "llama.cpp bf16"
OURS_BF16 = "ours bf16"         # our runtime on bf16 weights, measured beside our 4-bit weights
LLAMACPP = "llama.cpp"          # every llama.cpp side is named "llama.cpp <file type>"
LLAMACPP_Q4_1 = "llama.cpp q4_1"
EMBEDDED_LOAD_S = 3.0     # process start to ready, embedded model, kernel cache warm
BF16_RUNTIMES = (OURS, HF, LLAMACPP_BF16)   # those that read bf16 weights, the bf16 bound's bytes


def median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def ratio(ours: float | None, peer: float | None) -> float | None:
    return ours / peer if ours is not None and peer else None


@dataclass(frozen=True)
class Target:
    name: str
    row: str            # the table row it is shown on
    op: str             # "<=" or ">="
    limit: float
    value: float | None

    @property
    def status(self) -> str:
        if self.value is None:
            return "n/a"
        ok = self.value <= self.limit if self.op == "<=" else self.value >= self.limit
        return "PASS" if ok else "MISS"

    def to_dict(self) -> dict:
        return {**asdict(self), "status": self.status}


def paired_ratio(ours: list[float | None] | None, peer: list[float | None] | None) -> float | None:
    """The median over turns of ours ÷ peer within the turn, over the turns both decoded in."""
    pairs = [a / b for a, b in zip(ours or [], peer or []) if a is not None and b]
    return statistics.median(pairs) if pairs else None


def turn_bound_fraction(side: dict, turn_bandwidth: list[float | None], bytes_per_token: int) -> float | None:
    """The median over turns of a runtime's burst ÷ the bound at the bandwidth sampled in the
    same turn, over the turns that have both."""
    rates = side.get("runs", {}).get("decode_turns_tok_s") or []
    pairs = [rate * bytes_per_token / bw for rate, bw in zip(rates, turn_bandwidth) if rate is not None and bw]
    return statistics.median(pairs) if pairs else None


def host_share(side: dict, bytes_per_token: int, bandwidth_bytes_per_s: float | None) -> dict | None:
    """A runtime's decode step outside the device's runs (`DECODE_SPLIT`), and the fraction of
    the bound its decode would reach if the device's runs took exactly the bound's time: the
    ceiling the host's share alone sets, at the bandwidth given."""
    split = side.get(DECODE_SPLIT)
    if not split or not bandwidth_bytes_per_s:
        return None
    host = max(split["step_s"] - split["device_run_s"], 0.0)
    bound_s = bytes_per_token / bandwidth_bytes_per_s
    return {**split, "host_s": host, "bandwidth_bytes_per_s": bandwidth_bytes_per_s, "bytes_per_token": bytes_per_token,
            "ceiling": bound_s / (bound_s + host)}


def with_calls(calls: dict | None, share: dict | None) -> dict | None:
    """The cut pass's result, with the ceiling it and the host's share set together: the
    device's runs reading at the cut pass's rate, the host's time added."""
    if not calls or calls.get("error") or not share:
        return calls
    bound_s = share["bytes_per_token"] / share["bandwidth_bytes_per_s"]
    return {**calls, "ceiling_with_host": bound_s / (bound_s / calls["ratio"] + share["host_s"])}


def side_summary(raw: dict) -> dict:
    """Medians of one runtime's runs (raw runs kept alongside). Its decode rate is the median of
    its decode turns where it had any (`bench.turns`), else of its rounds."""
    if "error" in raw and not raw.get("ttft_s"):
        return {"error": raw["error"], "peak_rss_bytes": raw.get("peak_rss_bytes")}
    turns = [r for r in raw.get("decode_turns_tok_s") or [] if r is not None]
    rounds = median(raw.get("decode_tok_s"))
    return {
        "ttft_s": {int(n): median(v) for n, v in raw.get("ttft_s", {}).items()},
        "decode_tok_s": median(turns) if turns else rounds,
        "decode_rounds_tok_s": rounds,
        "peak_rss_bytes": raw.get("peak_rss_bytes"),
        "load_s": raw.get("load_s"),
        "wall_s": raw.get("wall_s"),
        "other_cores": raw.get("other_cores"),
        "info": raw.get("info", {}),
        **({PERPLEXITY: raw[PERPLEXITY]} if PERPLEXITY in raw else {}),
        **({DECODE_SPLIT: raw[DECODE_SPLIT]} if DECODE_SPLIT in raw else {}),
        "runs": {"ttft_s": raw.get("ttft_s", {}), "decode_tok_s": raw.get("decode_tok_s", []),
                 "decode_turns_tok_s": raw.get("decode_turns_tok_s", [])},
        **({"error": raw["error"]} if "error" in raw else {}),
    }


def ratios(sides: dict[str, dict], lengths: tuple[int, ...]) -> dict[str, dict[str, float | None]]:
    ours = sides.get(OURS, {})
    out = {}
    for peer, s in sides.items():
        if peer == OURS:
            continue
        r = {f"ttft@{n}": ratio(ours.get("ttft_s", {}).get(n), s.get("ttft_s", {}).get(n)) for n in lengths}
        turns = paired_ratio(*(x.get("runs", {}).get("decode_turns_tok_s") for x in (ours, s)))
        r["decode_rounds"] = ratio(ours.get("decode_rounds_tok_s"), s.get("decode_rounds_tok_s"))
        r["decode"] = turns if turns is not None else r["decode_rounds"]
        r["peak_rss"] = ratio(ours.get("peak_rss_bytes"), s.get("peak_rss_bytes"))
        r["load"] = ratio(ours.get("load_s"), s.get("load_s"))
        r[PERPLEXITY] = ratio(*(x.get(PERPLEXITY, {}).get("perplexity") for x in (ours, s)))
        out[peer] = r
    return out


def _fastest(rat: dict, sides: dict[str, dict], peers: list[str], key: str, highest: bool) -> float | None:
    """The ratio against whichever of `peers` did best on `key` (the highest rate or the lowest time)."""
    def value(p: str) -> float | None:
        s = sides.get(p, {})
        return s.get("decode_tok_s") if key == "decode" else s.get("ttft_s", {}).get(int(key.split("@")[1]))

    done = [p for p in peers if value(p) is not None]
    if not done:
        return None
    best = (max if highest else min)(done, key=value)
    return rat.get(best, {}).get(key)


def q4_targets(embedded: bool, rat: dict, sides: dict[str, dict], bound: tuple[str, float | None]) -> list[Target]:
    """A 4-bit bench's targets: against llama.cpp's best 4-bit type, our own bf16, the format's bound."""
    ours = sides.get(OURS, {})
    ppl = Target("perplexity ≤ 1.02× llama.cpp q4_1", PERPLEXITY, "<=", 1.02, rat.get(LLAMACPP_Q4_1, {}).get(PERPLEXITY))
    if embedded:
        return [ppl, Target(f"load ≤ {EMBEDDED_LOAD_S:g} s (warm cache)", "load", "<=", EMBEDDED_LOAD_S,
                            ours.get("load_s"))]
    peers = [p for p in sides if p.startswith(LLAMACPP)]
    own = rat.get(OURS_BF16, {})
    return [
        Target("TTFT@128 ≤ 1.0× llama.cpp's fastest 4-bit", "ttft@128", "<=", 1.0,
               _fastest(rat, sides, peers, "ttft@128", highest=False)),
        Target("TTFT@2048 ≤ 1.0× llama.cpp's fastest 4-bit", "ttft@2048", "<=", 1.0,
               _fastest(rat, sides, peers, "ttft@2048", highest=False)),
        Target("decode ≥ 1.1× llama.cpp's fastest 4-bit", "decode", ">=", 1.1,
               _fastest(rat, sides, peers, "decode", highest=True)),
        Target("decode ≥ 2.0× ours bf16", "decode", ">=", 2.0, own.get("decode")),
        Target("decode ≥ 85% of the q4nx bandwidth bound", bound[0], ">=", 0.85, bound[1]),
        Target("peak memory ≤ 0.45× ours bf16", "peak_rss", "<=", 0.45, own.get("peak_rss")),
        *([ppl] if ppl.value is not None else []),
    ]


def targets(embedded: bool, rat: dict, ours: dict, bound: tuple[str, float | None],
            memory_budget: int) -> list[Target]:
    """The bf16 targets: the 1B-class ones, or for the embedded model its decode vs HF and its load time.
    `bound` is our decode's fraction of the bandwidth bound and the table row it is measured on."""
    hf, lc = rat.get(HF, {}), rat.get(LLAMACPP_BF16, {})
    if embedded:
        return [Target("decode ≥ 1.0× HF", "decode", ">=", 1.0, hf.get("decode")),
                Target(f"load ≤ {EMBEDDED_LOAD_S:g} s (warm cache)", "load", "<=", EMBEDDED_LOAD_S, ours.get("load_s"))]
    peak = ours.get("peak_rss_bytes")
    return [
        Target("TTFT@128 ≤ 0.8× HF", "ttft@128", "<=", 0.8, hf.get("ttft@128")),
        Target("TTFT@2048 ≤ 1.0× HF", "ttft@2048", "<=", 1.0, hf.get("ttft@2048")),
        Target("TTFT@128 ≤ 1.0× llama.cpp bf16", "ttft@128", "<=", 1.0, lc.get("ttft@128")),
        Target("TTFT@2048 ≤ 1.0× llama.cpp bf16", "ttft@2048", "<=", 1.0, lc.get("ttft@2048")),
        Target("decode ≥ 85% of the bandwidth bound", bound[0], ">=", 0.85, bound[1]),
        Target("decode ≥ 1.2× llama.cpp bf16", "decode", ">=", 1.2, lc.get("decode")),
        Target("peak memory ≤ 1.5× (bf16 weights + KV cache)", "peak_rss", "<=", 1.5, ratio(peak, memory_budget)),
    ]


def perplexities(raw: dict[str, dict], reference: str) -> dict[str, dict]:
    """Each side's perplexity and its top-1 agreement with `reference` over the same positions."""
    ref = raw.get(reference, {}).get(PERPLEXITY, {}).get("top1")
    out = {}
    for name, r in raw.items():
        p = r.get(PERPLEXITY)
        if not p:
            continue
        if p.get("error"):
            out[name] = {"error": p["error"]}
            continue
        out[name] = {"perplexity": perplexity(p["nll"]), "tokens": len(p["nll"]), "seconds": p.get("seconds"),
                     "top1_agreement": agreement(p["top1"], ref) if ref else None}
    return out


def summarize_model(name: str, cfg: LlamaConfig, embedded: bool, lengths: tuple[int, ...], max_context: int,
                    raw: dict[str, dict], bandwidth_bytes_per_s: float | None, quant: str = "bf16",
                    turn_bandwidth: list[float | None] | None = None, call_structure: dict | None = None) -> dict:
    """`turn_bandwidth`: the bandwidth sampled in each decode turn, which bounds the bursts of
    the same turn (`bench.turns`); None where the turns did not sample it. `call_structure`:
    the bandwidth pass cut into our decode step's calls (`Stream.sample_calls`), if measured."""
    reference = OURS if quant == "bf16" else OURS_BF16
    scored = perplexities(raw, reference)
    sides = {k: {**side_summary({kk: vv for kk, vv in v.items() if kk != PERPLEXITY}),
                 **({PERPLEXITY: scored[k]} if k in scored else {})} for k, v in raw.items()}
    per_token = decode_bytes_per_token(cfg, quant)
    bound = decode_bound_tokens_per_s(per_token, bandwidth_bytes_per_s) if bandwidth_bytes_per_s else None
    weights = weight_bytes(cfg)
    kv = sides.get(OURS, {}).get("info", {}).get("kv_cache_bytes") or kv_cache_bytes(cfg, max_context)
    rat = ratios(sides, lengths)
    fraction = {k: ratio(s.get("decode_tok_s"), bound) for k, s in sides.items()}
    fraction_turns = {k: turn_bound_fraction(s, turn_bandwidth or [], per_token) for k, s in sides.items()}
    # Against the bound of each burst's own turn where the turns sampled the bandwidth, as the
    # decode ratio pairs bursts of one turn; else against the run's median bandwidth.
    ours_bound = (("bound_turns", fraction_turns[OURS]) if fraction_turns.get(OURS) is not None
                  else ("bound", fraction.get(OURS)))
    # At the bandwidth the target is read against: the turns' where they sampled it (a fraction
    # "bound_turns" exists only then).
    at = median([b for b in turn_bandwidth if b]) if ours_bound[0] == "bound_turns" else bandwidth_bytes_per_s
    share = host_share(sides.get(OURS, {}), per_token, at)
    if quant == "bf16":
        tg = targets(embedded, rat, sides.get(OURS, {}), ours_bound, weights + kv)
    else:
        tg = q4_targets(embedded, rat, sides, ours_bound)
    return {
        "model": name,
        "quant": quant,
        "config": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
                   "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size,
                   "tied": cfg.tie_word_embeddings},
        "weight_bytes": weights,
        "kv_cache_bytes": kv,
        "decode_bytes_per_token": per_token,
        "decode_bound_tok_s": bound,
        "bound_readers": list(BF16_RUNTIMES) if quant == "bf16" else [OURS],
        "bound_fraction": fraction,
        "bound_fraction_turns": fraction_turns,
        "turn_bandwidth": turn_bandwidth or [],
        "host_share": share,
        "call_structure": with_calls(call_structure, share),
        "perplexity_reference": reference,
        "runtimes": sides,
        "ratios": rat,
        "targets": [t.to_dict() for t in tg],
        "npu_estimate": npu_estimate(cfg, lengths, quant, sides.get(OURS, {}).get("info", {}).get("decode", "layers")),
    }


def npu_estimate(cfg: LlamaConfig, lengths: tuple[int, ...], quant: str = "bf16", decode: str = "layers") -> dict:
    """The cost model's NPU2 figures for this shape and weight format (an estimate from the
    modules, never run); for a fused decode (`decode` "fused"), the fused design's: its TTFT
    and its decode from 1K to 128K of context beside the published fused decodes."""
    from npu_runtime.cost.calibrate import CALIBRATION_NOTE
    from npu_runtime.cost.hardware import FITTED
    from npu_runtime.cost.model import estimate_phases

    if decode == "fused":
        from npu_runtime.cost.fused_report import bench_estimate

        try:
            return bench_estimate(cfg, lengths, quant)
        except (ValueError, KeyError, IndexError) as e:      # a shape the builders cannot tile
            return {"error": str(e)}
    try:
        phases = {n: estimate_phases(cfg, FITTED, n, quant) for n in lengths}
    except (ValueError, KeyError) as e:      # a shape the builders cannot tile
        return {"error": str(e)}
    any_phase = next(iter(phases.values()))
    return {"ttft_s": {str(n): p.ttft_s for n, p in phases.items()},
            "decode_tok_s": any_phase.decode_tokens_per_s, "calibration": CALIBRATION_NOTE}
