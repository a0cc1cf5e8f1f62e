"""`python -m verify`: the top-k gate (`make verify`, `make verify-full`).

Prints one `[verify] PASS` or `[verify] FAIL` line for scripts to match, and exits 1 on a
failed gate, 2 when verification could not run at all (so "wrong numbers" and "could not
check" never look alike).
"""
from __future__ import annotations

import argparse
import sys

from llama_base.errors import UserError
from verify.gate import run_gate
from verify.prepare import add_model_args


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verify", description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--prompts", type=int, default=2, help="how many prompts of the set to run")
    ap.add_argument("--n-tokens", type=int, default=32, help="greedy steps per prompt (fewer if an end token comes)")
    args = ap.parse_args(argv)
    if args.n_tokens < 1:
        ap.error("--n-tokens must be at least 1")
    try:
        run = run_gate(args.model, args.device, args.prompts, args.n_tokens, quant=args.quant, decode=args.decode)
    except UserError as e:
        print(f"[verify] ERROR: {e}", file=sys.stderr)
        return 2
    for i, g in enumerate(run.gates):
        d = g.first_divergence
        where = "no divergence" if d is None else f"first divergence at step {d.step}"
        print(f"[verify] prompt {i}: {g.agreements}/{g.steps} steps agree, {where}: {'ok' if g.passed else 'FAIL'}")
    print(f"[verify] report: {run.reports[1]}")
    print(f"[verify] {'PASS' if run.passed else 'FAIL'}", flush=True)
    return 0 if run.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
