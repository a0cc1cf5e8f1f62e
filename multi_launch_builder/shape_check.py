"""Whether a model's shapes tile onto the NPU's groups, asked before any weight is read.

A checkpoint's config decides every group's tiling (`kernel_builder.backend_presets`); a shape
the presets cannot tile, or whose tiling breaks a hardware rule (`hw_rules`: L1 budgets, DMA
runs of whole words, descriptors), would otherwise fail minutes into a load (the 8B's weights)
or deep in a group's build, as a page of validator output. Here the groups a session compiles
are declared at their smallest sizes, and the ones whose tilings depend on the shapes in
different ways (the projections, the FFN, the head, prefill and decode attention) are built and
validated: a problem is one line naming the dimension and the rule it breaks.

The verdict is kept under the kernel cache, keyed by the shapes, the format and what the
builders are made from (`sources.builder_sources_hash`, the kernel cache's key too), so a model that passed costs a file lookup on
every later start (the first costs about a second).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path

from kernel_builder import fused_groups, groups
from llama_base.config import LlamaConfig
from llama_base.group_contract import KernelGroup
from llama_base.paths import kernels_dir
from multi_launch_builder import compile as compile_module
from multi_launch_builder.mlir_validate import MlirValidationError
from multi_launch_builder.sources import builder_sources_hash

ATTENTION_OPS = ("flash_attn", "decode_attn", "attn_merge", "kv_append")
MATMUL_OPS = ("gemm", "gemv", "gemm_q4nx", "gemv_q4nx")
SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "vocab_size")


def _probe_groups(cfg: LlamaConfig, quant: str) -> list[KernelGroup]:
    """Every kind a session compiles, at the smallest prefill bucket and the smallest resident
    cache: what differs at larger sizes is how many tiles run, not how one is cut."""
    bucket = groups.prefill_buckets(cfg)[0]
    out = [groups.build_group(kind, cfg, bucket, quant=quant) for kind in ("rms_gemms_rope", "flash_attn", "o_ffn")]
    out += [groups.build_group(kind, cfg, quant=quant) for kind in ("rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv")]
    capacity = fused_groups.cache_capacity(cfg, fused_groups.SMALLEST_WINDOW, bucket)
    out.append(fused_groups.resident_flash_attn(cfg, bucket, capacity))
    out.append(fused_groups.fused_decode(replace(cfg, num_hidden_layers=1), capacity, quant))
    return out


def _shapes(cfg: LlamaConfig) -> str:
    return (f"hidden {cfg.hidden_size}, FFN {cfg.intermediate_size}, {cfg.num_attention_heads}/"
            f"{cfg.num_key_value_heads} heads of {cfg.head_dim}, vocabulary {cfg.vocab_size}")


def _dimension(cfg: LlamaConfig, group: KernelGroup, problem: str) -> str:
    """The model dimension a validator problem of `group` comes from: the launch it names."""
    m = re.search(r"launch (\S+)_launch", problem)
    launch = next((l for l in group.launches if m and l.name == m.group(1)), None)
    if launch is None:
        return f"the {group.kind} group"
    p = launch.param_dict
    if launch.op in ATTENTION_OPS:
        return (f"head_dim {cfg.head_dim} ({cfg.num_attention_heads} query heads over {cfg.num_key_value_heads} "
                f"KV heads)")
    if launch.op in MATMUL_OPS and "N" in p and "K" in p:
        return f"the {launch.name.removeprefix('L0_')} weight, {p['N']} x {p['K']}"
    return f"the {launch.name} launch"


def tiling_problem(cfg: LlamaConfig, quant: str = "bf16") -> str | None:
    """One line naming the dimension and the rule, or None where every group tiles."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        return (f"{cfg.num_attention_heads} query heads over {cfg.num_key_value_heads} KV heads: grouped-query "
                "attention needs a whole number of query heads per KV head")
    if cfg.head_dim % 2:
        return f"head_dim {cfg.head_dim}: RoPE rotates pairs of a head's values, so it must be even"
    try:
        probes = _probe_groups(cfg, quant)
    except ValueError as e:         # a preset found no tiling: its message names the matrix
        return f"{_shapes(cfg)}: {str(e).splitlines()[0]}"
    for g in probes:
        try:
            compile_module.compile_group_mlir(g)
        except MlirValidationError as e:
            first = e.problems[0]
            rule = first.split(": ", 1)[-1]
            rule = re.sub(r"^launch \S+, herd \S+, \S+ \(line \d+\): ", "", rule)
            return f"{_dimension(cfg, g, first)}: {rule}"
        except ValueError as e:
            return f"{_shapes(cfg)}: the {g.kind} group: {str(e).splitlines()[0]}"
    return None


def _key(cfg: LlamaConfig, quant: str) -> str:
    """The shapes, the format, and what the builders and the validator are made from."""
    return hashlib.sha256(json.dumps([{k: getattr(cfg, k) for k in SHAPE_KEYS}, quant,
                                      builder_sources_hash()]).encode()).hexdigest()[:20]


def check_tiles(cfg: LlamaConfig, quant: str = "bf16", memo: Path | None = None) -> str | None:
    """`tiling_problem`, remembered for these shapes and this code (`memo`: the folder; the
    kernel cache's `shapes/` unless given). A verdict that cannot be written is still given."""
    folder = memo if memo is not None else kernels_dir() / "shapes"
    path = folder / f"{_key(cfg, quant)}.json"
    try:
        return json.loads(path.read_text())["problem"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    problem = tiling_problem(cfg, quant)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")     # another process may write the same verdict
        tmp.write_text(json.dumps({"problem": problem}))
        tmp.replace(path)
    except OSError:
        pass
    return problem
