"""`python -m verify.diagnosis`: where ours and HF part ways, layer by layer (`make diagnosis`).

When the gate fails, the question is which layer went wrong. One prompt is prefilled on both
sides and every layer's output hidden state is compared (cosine over all prompt rows, and the
largest elementwise difference next to the reference's own largest magnitude for scale),
then the final normed row and the logits. bf16 noise keeps a correct layer's cosine near 1
all the way down; a bug shows as a drop at the layer that has it, and every later layer
inherits it. A layer counts as low when either its whole-tensor cosine or its worst row's is
under `COSINE_FLOOR`: trained models carry a few huge activations that dominate the whole
tensor's cosine (it stays near 1 while every other row is wrong), and a RoPE error leaves
position 0 exact, so the whole-tensor number alone can miss both. The table is informational
(exit 0); `first_low_layer` names the first low layer.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from llama_base.errors import UserError
from verify.compare import HiddenDiff, hidden_diff, rank_of
from verify.hf_side import peak_rss_mib, run_in_child
from verify.our_runner import OurRunner
from verify.prepare import Prepared, add_model_args, build_ours, prepare
from verify.report import md_table, token_label, write_report

# A correct bf16 layer stays well above this; the 1B-shape test asserts it on every layer.
COSINE_FLOOR = 0.99


@dataclass
class DiagnosisRun:
    prep: Prepared
    device: str
    layers: list[HiddenDiff]
    final_normed: HiddenDiff
    logits: HiddenDiff
    hf_top1: int
    our_top1: int
    hf_top1_rank_in_ours: int
    timings: dict = field(default_factory=dict)
    memory_mib: dict = field(default_factory=dict)
    reports: tuple[Path, Path] | None = None

    @property
    def first_low_layer(self) -> int | None:
        return next((i for i, d in enumerate(self.layers) if is_low(d)), None)


def is_low(d: HiddenDiff) -> bool:
    return min(d.cosine, d.worst_row_cosine) < COSINE_FLOOR


def run_diagnosis(model: str, device: str, log: Callable[[str], None] = print, quant: str = "bf16",
                  decode: str = "auto") -> DiagnosisRun:
    """Prefill the first prompt of the model's set on both sides and compare every layer."""
    prep = prepare(model, 1, log, quant)
    ids = prep.prompt_ids[0]
    with tempfile.TemporaryDirectory(prefix="verify-hf-") as tmp:
        log(f"[diagnosis] HF transformers reference: prefill of {len(ids)} tokens")
        hf, hf_meta = run_in_child(prep.hf_job("layers", [ids]), Path(tmp))
    t0 = time.perf_counter()
    session = build_ours(prep, device, log, decode)
    t1 = time.perf_counter()
    ours = OurRunner(session).prefill(ids, keep_layers=True)
    hf_top1 = int(hf["logits"].argmax())
    run = DiagnosisRun(
        prep, session.device.kind,
        [hidden_diff(o, r) for o, r in zip(ours.layers, hf["layers"], strict=True)],
        hidden_diff(ours.final_normed, hf["final_normed"]), hidden_diff(ours.logits, hf["logits"]),
        hf_top1, ours.top1, rank_of(ours.logits, hf_top1),
        {"hf_s": hf_meta["seconds"], "ours_build_s": t1 - t0, "ours_prefill_s": time.perf_counter() - t1},
        {"hf_peak_rss": hf_meta["peak_rss_mib"], "ours_peak_rss": peak_rss_mib()},
    )
    run.reports = write_report("diagnosis", _json(run, len(ids)), _markdown(run, len(ids)))
    return run


def _rows(run: DiagnosisRun) -> list[list[object]]:
    def row(label: object, d: HiddenDiff, flag: str) -> list[object]:
        return [label, f"{d.cosine:.6f}", f"{d.worst_row_cosine:.6f}", f"{d.max_abs:.4g}", f"{d.ref_max_abs:.4g}", flag]

    rows = [row(i, d, "LOW" if is_low(d) else "") for i, d in enumerate(run.layers)]
    return rows + [row("final norm", run.final_normed, ""), row("logits", run.logits, "")]


HEADER = ["layer", "cosine", "worst row", "max abs diff", "HF max abs", f"below {COSINE_FLOOR}"]


def _json(run: DiagnosisRun, n: int) -> dict:
    p = run.prep
    return {"kind": "diagnosis", "model": p.model, "resolved": p.name, "folder": str(p.folder),
            "device": run.device, "prompt": p.prompts[0], "prompt_ids": p.prompt_ids[0], "prompt_tokens": n,
            "cosine_floor": COSINE_FLOOR, "first_low_layer": run.first_low_layer,
            "layers": [asdict(d) for d in run.layers], "final_normed": asdict(run.final_normed),
            "logits": asdict(run.logits), "hf_top1": run.hf_top1, "our_top1": run.our_top1,
            "hf_top1_rank_in_ours": run.hf_top1_rank_in_ours, "timings_s": run.timings,
            "peak_rss_mib": run.memory_mib}


def _summary(run: DiagnosisRun) -> str:
    low = run.first_low_layer
    where = f"first layer below cosine {COSINE_FLOOR}: {low}" if low is not None else \
        f"every layer at cosine >= {COSINE_FLOOR} (whole tensor and worst row)"
    tok = run.prep.tokenizer
    return (f"{where}; next token HF {token_label(tok, run.hf_top1)}, ours {token_label(tok, run.our_top1)} "
            f"(HF's choice ranks {run.hf_top1_rank_in_ours} in ours)")


def _markdown(run: DiagnosisRun, n: int) -> str:
    p = run.prep
    return "\n".join([
        "# diagnosis: per-layer output hidden state, ours vs HF transformers bf16", "",
        f"Model {p.label}, device `{run.device}`, prompt {p.prompts[0]!r} ({n} tokens).", "",
        md_table(HEADER, _rows(run)), "", _summary(run) + ".",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verify.diagnosis", description=__doc__.splitlines()[0])
    add_model_args(ap)
    args = ap.parse_args(argv)
    try:
        run = run_diagnosis(args.model, args.device, quant=args.quant, decode=args.decode)
    except UserError as e:
        print(f"[diagnosis] ERROR: {e}", file=sys.stderr)
        return 2
    widths = [11, 10, 10, 13, 11, 10]
    for row in [HEADER] + _rows(run):
        print("[diagnosis] " + " ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    print(f"[diagnosis] {_summary(run)}")
    print(f"[diagnosis] report: {run.reports[1]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
