"""`python -m bench` (`make bench`): this runtime vs HF transformers and llama.cpp, one machine, one run.

Prints the tables and writes `bench-<time>.json` / `.md` under the reports folder, with the
decode-at-depth plot beside them (`bench-<time>-depth.png`). Missed
targets do not fail the command (a bench measures; the verification gates): exit 0 when the
bench ran, 2 when it could not (bad arguments, an unusable model).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from bench.machine import CLASS_ENV, CPU_CLASSES
from bench.plan import FULL, QUICK, only_depth, with_depths, with_types
from bench.run import run_bench
from llama_base.errors import UserError
from llama_runtime.checkpoints.resolve import EMBEDDED, LLAMA1B_SHAPE
from llama_runtime.cli.options import add_model_options

DEFAULT_MODELS = f"{LLAMA1B_SHAPE},{EMBEDDED}"


def _depths(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none", "0"):
        return ()
    try:
        depths = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, got {text!r}") from None
    if any(d < 1 for d in depths):
        raise argparse.ArgumentTypeError(f"a depth holds at least one position, got {text!r}")
    return depths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    add_model_options(ap, devices=("auto", "npu", "sim"), device_help="our runtime's device",
                      quant_help="our weight format: bf16 (against HF and llama.cpp bf16/q8_0) or q4nx (against "
                                 "llama.cpp q4_0/q4_1/q4_k_m and our own bf16)",
                      decode=True, without=("model",))   # a bench measures a list of models, `--models`
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help=f"comma-separated models (names or checkpoint folders); default {DEFAULT_MODELS}")
    ap.add_argument("--quick", action="store_true", help="a short smoke run of every path (not a result)")
    ap.add_argument("--depths", type=_depths, metavar="N,N,...",
                    help=f"context depths of the decode-at-depth section, comma-separated, or none "
                         f"(default {','.join(map(str, FULL.depths))}; --quick {','.join(map(str, QUICK.depths))})")
    ap.add_argument("--depth-only", action="store_true",
                    help="only decode at depth (no rounds, turns or perplexity; the 4-bit peer is then "
                         "llama.cpp's q4_0)")
    ap.add_argument("--llamacpp-types", metavar="T,T,...",
                    help="measure only these of llama.cpp's types of our weights class (default: all of them)")
    ap.add_argument("--skip-llamacpp", action="store_true", help="do not build or run llama.cpp")
    ap.add_argument("--rebuild-llamacpp", action="store_true", help="retry a llama.cpp build that failed before")
    ap.add_argument("--cpu-class", default="native", choices=tuple(CPU_CLASSES),
                    help="run every runtime as on a CPU of this class (avx2: no AVX-512, AMX or AVX-VNNI)")
    args = ap.parse_args(argv)
    os.environ.update(CLASS_ENV[args.cpu_class])      # inherited by every runtime's child process
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        ap.error("--models names no model")
    plan = replace((QUICK if args.quick else FULL).for_quant(args.quant), decode=args.decode)
    if args.depths is not None:
        plan = with_depths(plan, args.depths)
    if args.llamacpp_types:
        if args.depth_only:
            ap.error("--llamacpp-types does not apply to --depth-only, whose one peer is the class's first type")
        try:
            plan = with_types(plan, tuple(t.strip().lower() for t in args.llamacpp_types.split(",") if t.strip()))
        except ValueError as e:
            ap.error(str(e))
    if args.depth_only:
        if not plan.depths:
            ap.error("--depth-only needs at least one depth (--depths none leaves nothing to run)")
        plan = only_depth(plan)
    try:
        _, md, (jpath, mpath) = run_bench(models, plan, args.device, args.skip_llamacpp, args.rebuild_llamacpp,
                                          cpu_class=args.cpu_class)
    except UserError as e:
        print(f"[bench] ERROR: {e}", file=sys.stderr)
        return 2
    print(md)
    print(f"\n[bench] report: {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
