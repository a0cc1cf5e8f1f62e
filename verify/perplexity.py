"""`python -m verify.perplexity` (`make perplexity`): what 4-bit weights cost on real English text.

Scores the same chunks of `verify.eval_text` with our runtime in every weight format asked for
(bf16 and q4nx by default), one session at a time, and reports each format's perplexity and how
often its top-1 token agrees with bf16's at the same position. `--hf` adds HF transformers bf16
on the same checkpoint as an outside reference for the bf16 figure. The bench reports the same
measure for llama.cpp's 4-bit types (`make bench QUANT=q4nx`).

A random-weight model (the 1B shape, tiny) gets a perplexity near its vocabulary size whatever
the format: it is measured if asked for, with a note, but says nothing about quantization.
Exit 0 when measured, 2 when it could not be (a missing text or model).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

from llama_base.weight_formats import QUANTS
from llama32_1b_inference import build_session
from llama_base.errors import UserError
from llama_runtime.checkpoints.resolve import SHAPES, TINIES, resolve_model
from llama_runtime.cli.options import add_model_options
from llama_runtime.text.tokenizer import Tokenizer
from verify import VerifyError
from verify.eval_text import CHUNK_LEN, N_CHUNKS, SOURCE, eval_chunks
from verify.report import md_table, write_report
from verify.scoring import agreement, perplexity, score_chunks

RANDOM_WEIGHTS = SHAPES + TINIES
HF_LABEL = "HF transformers bf16"


def _ours(resolved, quant: str, device: str, chunks: list[list[int]], log) -> dict:
    from verify.our_runner import OurRunner

    session = build_session(resolved, device=device, quant=quant, max_context=len(chunks[0]), log=log)
    t0 = time.perf_counter()
    scores = score_chunks(OurRunner(session), chunks)
    scores["seconds"] = time.perf_counter() - t0
    scores["device"] = session.device.name
    del session
    gc.collect()
    return scores


def _hf(folder, chunks: list[list[int]]) -> dict:
    from verify.hf_runner import HFRunner

    t0 = time.perf_counter()
    scores = score_chunks(HFRunner(folder), chunks)
    scores["seconds"] = time.perf_counter() - t0
    return scores


def measure(model: str, quants: list[str], device: str = "auto", n_chunks: int = N_CHUNKS,
            chunk_len: int = CHUNK_LEN, hf: bool = False, log=print) -> dict:
    """Each format's scores over the same chunks, with perplexity and agreement with the first format."""
    resolved = resolve_model(model, log)
    if resolved.fallback_note:
        log(f"[model] {resolved.fallback_note}")
    chunks = eval_chunks(Tokenizer(resolved.folder, resolved.config), n_chunks, chunk_len)
    runs: dict[str, dict] = {}
    for q in quants:
        log(f"[perplexity] {resolved.name} {q}: {n_chunks} chunks of {chunk_len} tokens ...")
        runs[q] = _ours(resolved, q, device, chunks, log)
    if hf:
        log(f"[perplexity] {resolved.name} {HF_LABEL} ...")
        runs[HF_LABEL] = _hf(resolved.folder, chunks)
    reference = runs[quants[0]]["top1"]
    rows = {name: {"perplexity": perplexity(r["nll"]), "top1_agreement": agreement(r["top1"], reference),
                   "tokens": len(r["nll"]), "seconds": r["seconds"]} for name, r in runs.items()}
    return {"model": resolved.name, "folder": str(resolved.folder), "text": SOURCE, "chunks": n_chunks,
            "chunk_len": chunk_len, "reference": quants[0], "results": rows,
            "random_weights": model in RANDOM_WEIGHTS or resolved.name in RANDOM_WEIGHTS}


def markdown(data: dict) -> str:
    ref = data["reference"]
    lines = [f"# Perplexity of `{data['model']}`", "",
             f"Text: {data['text']}; {data['chunks']} chunks of {data['chunk_len']} tokens, each scored after "
             "BOS on its own.", ""]
    rows = [[name, f"{r['perplexity']:.3f}", f"{r['top1_agreement']:.1%}", r["tokens"], f"{r['seconds']:.1f}"]
            for name, r in data["results"].items()]
    lines.append(md_table(["weights", "perplexity", f"top-1 agreement with {ref}", "tokens scored", "seconds"], rows))
    if data["random_weights"]:
        lines += ["", "Random weights: these figures say nothing about quantization."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verify.perplexity", description=__doc__.splitlines()[0])
    add_model_options(ap, without=("quant",))       # the formats compared are a list, `--quants`
    ap.add_argument("--quants", default=",".join(QUANTS),
                    help=f"comma-separated weight formats, the first the reference (default {','.join(QUANTS)})")
    ap.add_argument("--chunks", type=int, default=N_CHUNKS, help=f"chunks of text to score (default {N_CHUNKS})")
    ap.add_argument("--chunk-len", type=int, default=CHUNK_LEN, help=f"tokens per chunk (default {CHUNK_LEN})")
    ap.add_argument("--hf", action="store_true", help="also score HF transformers bf16 on the same checkpoint")
    args = ap.parse_args(argv)
    quants = [q.strip() for q in args.quants.split(",") if q.strip()]
    unknown = [q for q in quants if q not in QUANTS]
    if not quants or unknown:
        ap.error(f"--quants: unknown {', '.join(unknown) or 'empty list'}; known: {', '.join(QUANTS)}")
    try:
        data = measure(args.model, quants, args.device, args.chunks, args.chunk_len, args.hf)
    except (UserError, VerifyError) as e:
        print(f"[perplexity] ERROR: {e}", file=sys.stderr)
        return 2
    md = markdown(data)
    jpath, mpath = write_report("perplexity", data, md)
    print(md)
    print(f"\n[perplexity] report: {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
