"""The top-k gate: HF decodes greedily, we are teacher-forced along its tokens, ranks are compared.

Teacher forcing keeps both sides on one token sequence, so a single early near-tie flip does
not send the two generations into different texts whose logits can no longer be compared;
every one of the steps is checked. Our side runs in the calling process, after the HF child
has exited, so a test can patch the runtime around a call (a deliberately broken kernel) and
watch the gate fail.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from verify.compare import TOP_K, PromptGate, gate_prompt
from verify.hf_side import peak_rss_mib, run_in_child
from verify.our_runner import OurRunner
from verify.prepare import Prepared, build_ours, prepare
from verify.report import md_table, token_label, write_report
from verify.runner import run_trace


@dataclass
class GateRun:
    prep: Prepared
    device: str
    n_tokens: int
    gates: list[PromptGate]
    hf_tokens: list[list[int]]
    timings: dict = field(default_factory=dict)
    memory_mib: dict = field(default_factory=dict)
    reports: tuple[Path, Path] | None = None

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)


def run_gate(model: str, device: str, n_prompts: int, n_tokens: int,
             log: Callable[[str], None] = print, quant: str = "bf16", decode: str = "auto") -> GateRun:
    """Run both sides on `n_prompts` prompts for up to `n_tokens` steps and write the reports."""
    prep = prepare(model, n_prompts, log, quant)
    with tempfile.TemporaryDirectory(prefix="verify-hf-") as tmp:
        log(f"[verify] HF transformers reference: {len(prep.prompts)} prompt(s), up to {n_tokens} greedy tokens")
        hf, hf_meta = run_in_child(prep.hf_job("trace", prep.prompt_ids, n_tokens=n_tokens, end_ids=prep.end_ids),
                                   Path(tmp))
    t0 = time.perf_counter()
    session = build_ours(prep, device, log, decode)
    t1 = time.perf_counter()
    runner = OurRunner(session)
    gates, hf_tokens = [], []
    for i, ids in enumerate(prep.prompt_ids):
        forced = hf[f"p{i}.tokens"].tolist()
        ours = run_trace(runner, ids, n_tokens, prep.end_ids, forced=forced)
        gates.append(gate_prompt(hf[f"p{i}.logits"], ours.logits))
        hf_tokens.append(forced)
    run = GateRun(prep, session.device.kind, n_tokens, gates, hf_tokens,
                  {"hf_s": hf_meta["seconds"], "ours_build_s": t1 - t0, "ours_traces_s": time.perf_counter() - t1},
                  {"hf_peak_rss": hf_meta["peak_rss_mib"], "ours_peak_rss": peak_rss_mib()})
    run.reports = write_report("verify", _json(run, hf_meta), _markdown(run))
    return run


def _json(run: GateRun, hf_meta: dict) -> dict:
    p = run.prep
    return {
        "kind": "verify", "passed": run.passed, "top_k": TOP_K, "model": p.model, "resolved": p.name,
        "folder": str(p.folder), "device": run.device, "chat": p.chat, "n_tokens": run.n_tokens,
        "reference": {"transformers": hf_meta["transformers"], "torch": hf_meta["torch"], "dtype": "bfloat16"},
        "timings_s": run.timings, "peak_rss_mib": run.memory_mib,
        "prompts": [{"prompt": text, "prompt_ids": ids, "hf_tokens": toks, **g.to_json()}
                    for text, ids, toks, g in zip(p.prompts, p.prompt_ids, run.hf_tokens, run.gates)],
    }


def _markdown(run: GateRun) -> str:
    p, tok = run.prep, run.prep.tokenizer
    rows = []
    for i, (text, g) in enumerate(zip(p.prompts, run.gates)):
        d = g.first_divergence
        rows.append([i, text, g.steps, g.agreements, "none" if d is None else d.step,
                     "" if d is None else f"{token_label(tok, d.hf_token)}, rank {d.hf_token_rank_in_ours} in ours",
                     "" if d is None else f"{token_label(tok, d.our_token)}, rank {d.our_token_rank_in_hf} in HF",
                     "PASS" if g.passed else "FAIL"])
    fails = [(i, d) for i, g in enumerate(run.gates) for d in g.divergences if not d.ok]
    out = [f"# verify: {'PASS' if run.passed else 'FAIL'}", "",
           f"Model {p.label}, device `{run.device}`, {'chat' if p.chat else 'base'} prompts, "
           f"up to {run.n_tokens} teacher-forced greedy steps, top-{TOP_K} gate vs HF transformers bf16.", "",
           md_table(["#", "prompt", "steps", "agree", "first divergence", "HF choice", "our choice", "result"], rows)]
    if fails:
        out += ["", "## Failing steps", "",
                md_table(["#", "step", "HF choice", "rank in ours", "our choice", "rank in HF"],
                         [[i, d.step, token_label(tok, d.hf_token), d.hf_token_rank_in_ours,
                           token_label(tok, d.our_token), d.our_token_rank_in_hf] for i, d in fails])]
    t, m = run.timings, run.memory_mib
    out += ["", f"HF side {t['hf_s']:.1f} s (peak RSS {m['hf_peak_rss']:.0f} MiB); ours: build "
                f"{t['ours_build_s']:.1f} s, traces {t['ours_traces_s']:.1f} s "
                f"(peak RSS {m['ours_peak_rss']:.0f} MiB)."]
    return "\n".join(out)
