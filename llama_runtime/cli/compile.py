"""`make compile` (`python -m llama_runtime.cli.compile`): every kernel group of a model into the
kernel cache: the stitched, validated MLIR-AIR everywhere, ELFs where aircc and Peano exist.

It sits on the run side, above the KernelCache, because what it fills is the cache `make run`
reads (same keys, same entries); the pipeline itself is `multi_launch_builder.compile`.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Sequence

from kernel_builder import groups

from kernel_builder.external_kernels import build_group_objects
from llama_base.config import LlamaConfig
from llama_base.errors import UserError
from llama_runtime.checkpoints.resolve import resolve_model
from llama_runtime.checkpoints.q4nx_weights import wide_sets
from kernel_builder.fused_groups import resident_groups
from llama_base.group_contract import DECODE_KINDS
from llama_runtime.cli.options import add_model_options, positive_int
from llama_runtime.engine.device_model import DECODE_MODES, choose_decode
from llama_runtime.engine.kv_cache import DEFAULT_MAX_CONTEXT, context_positions
from multi_launch_builder.compile import ToolchainError, default_objects_dir, toolchain
from npu_runtime.cache import KernelCache
from npu_runtime.devices import open_device
from npu_runtime.xrt.device import NpuTarget


def _config(args: argparse.Namespace) -> tuple[LlamaConfig, tuple[frozenset[str], ...]]:
    """The shapes, and the sets of weights the model's layers keep in bf16 under a quantized
    format (a GGUF's wider tensors, `q4nx_weights.wide_sets`): each is a variant of its groups."""
    uniform = (frozenset(),)
    if args.model_config:
        return LlamaConfig.from_json(args.model_config), uniform
    if args.model:
        resolved = resolve_model(args.model, print, args.quant)
        if resolved.fallback_note:
            print(f"[model] {resolved.fallback_note}")
        return resolved.config, uniform if args.quant == "bf16" else wide_sets(resolved.gguf, resolved.config)
    return LlamaConfig(), uniform


def _targets(device: str):
    """The runtime device's artifacts, plus NPU ELFs whenever the toolchain is here (even with no NPU)."""
    dev = open_device(device)
    out = [dev]
    tc = toolchain()
    if dev.kind != "npu":
        if tc.complete:
            out.append(NpuTarget())
        else:
            print(f"[compile] ELFs skipped: missing {', '.join(tc.missing())} "
                  "(the MLIR of every group is still built, stitched and validated)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Compile every group through the KernelCache: a second run finds everything cached."""
    ap = argparse.ArgumentParser(
        prog="python -m llama_runtime.cli.compile",
        description="Build, stitch and validate every kernel group into the kernel cache; ELFs where aircc exists.")
    ap.add_argument("--model-config", help="config.json (or its folder) giving the shapes")
    add_model_options(ap, model=None,
                      model_help="checkpoint (folder, .gguf file, repo id or alias) whose config gives the shapes",
                      quant_help="the weight format the groups read")
    ap.add_argument("--max-seq", type=int, help="largest prefill bucket to build")
    ap.add_argument("--max-context", type=positive_int,
                    help=f"the context the fused decode's windows cover (default: a run's, {DEFAULT_MAX_CONTEXT} "
                         "capped at the model's limit)")
    ap.add_argument("--decode", choices=("both", "auto") + DECODE_MODES, default="both",
                    help="the decodes whose groups to build: both (default), or the one a run takes (auto, "
                         "layers, fused)")
    ap.add_argument("--out", help="also copy each stitched .mlir here, for reading")
    args = ap.parse_args(argv)
    try:
        cfg, wide = _config(args)
        decode = args.decode if args.decode == "both" else choose_decode(args.decode)
        buckets = groups.prefill_buckets(cfg, args.max_seq)
        all_groups = groups.all_groups(cfg, buckets, args.quant, wide)
        if decode == "fused":      # the card's decode groups are not called
            all_groups = [g for g in all_groups if g.kind not in DECODE_KINDS]
        if decode != "layers":
            # A model whose layers keep different weights wide builds its fused groups on first run.
            all_groups += resident_groups(cfg, buckets, context_positions(cfg, args.max_context), args.quant)
        for target in _targets(args.device):
            kc = KernelCache(target, refresh_toolchain=True)   # a new aircc/Peano rebuilds here, never in a run
            built = cached = 0
            for g in all_groups:
                before = kc.stats.compiled
                entry = kc.compile_and_cache(g)
                fresh = kc.stats.compiled > before
                built, cached = built + fresh, cached + (not fresh)
                state = "built (MLIR stitched and validated)" if fresh else "cached"
                print(f"[compile] {g.name}: {len(g.launches)} launches; {target.kind} artifact {state} ({entry.name})")
                if args.out and (entry / "group.mlir").exists():
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    shutil.copy(entry / "group.mlir", Path(args.out) / f"{g.name}.mlir")
            print(f"[compile] {target.kind}: {built} built, {cached} already cached in {kc.dir}")
        results = build_group_objects(all_groups, default_objects_dir())
        for status in ("built", "up-to-date", "skipped"):
            hits = [r for r in results if r.status == status]
            if hits:
                why = f": {hits[0].reason}" if status == "skipped" and hits[0].reason else ""
                print(f"[compile] kernel objects {status}: {len(hits)}{why}")
        return 0
    except (UserError, ToolchainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
