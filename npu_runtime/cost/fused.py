"""The fused decode (`kernel_builder.fused_groups`) priced a token at a time.

A token is one call: the stitched `fused_decode` module, counted at the token's position (the
i32 `pos` its attention cores read, depth - 1 for a live context of `depth` positions), each
launch priced as `model.py` prices any launch, plus one call's overhead. Decode attention's
launches (`decode_attn`) run at the calibration's `attention_efficiency`: a core there multiplies
one token's few query rows of a KV head (4 for Llama-3.2-1B) by chunks of cached positions, a
shape the GEMMs' efficiency says nothing about.

Two forms of the same module:
- the *whole window*, upstream's build: capacity = window = the context, every position live,
  so each token moves all of it (`fused_decode_estimate(..., window=context)`);
- *ours*: a cache for `OUR_CONTEXT` positions and the staircase's window of the live depth
  (`fused_groups.window_for`), so its bytes follow the live context within the staircase's step (at most 1.5 times).

`fused_fit.py` fits the calibration to upstream's published fused decode and validates it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kernel_builder import groups
from kernel_builder.fused_groups import cache_capacity, fused_decode, resident_flash_attn, window_for
from llama_base.config import LlamaConfig
from llama_base.group_contract import KernelGroup, Role
from npu_runtime.cost.count_cache import cached_counts
from npu_runtime.cost.counts import LaunchCounts
from npu_runtime.cost.hardware import Calibration
from npu_runtime.cost.model import GroupEstimate, LaunchTime, estimate_group, launch_components, launch_time

ATTENTION_OP = "decode_attn"
# The context our cache is built for in the estimates (the model's 128K), and the largest
# prefill bucket whose padding rows its capacity leaves room for.
OUR_CONTEXT = 131072
PREFILL_BUCKET = 2048


def attention_calibration(cal: Calibration) -> Calibration:
    """`cal` as a decode-attention launch is priced: its contractions at the attention efficiency."""
    return replace(cal, gemm_efficiency=cal.attention_efficiency)


def with_attention_herd(group: KernelGroup, herd: tuple[int, int]) -> KernelGroup:
    """The fused group with its decode attention on a herd of `herd` (columns, rows) instead of
    the presets' 8x4: each KV head's positions split over cols·rows / kv_heads cores (1: a core a
    head, every position), the partial-sum slots and the merge resized to match. What the
    validation prices upstream's 8-core attention with."""
    attn = [l for l in group.launches if l.op == ATTENTION_OP]
    if not attn:
        raise ValueError(f"{group.name} has no {ATTENTION_OP} launch")
    kvh = attn[0].p("kv_heads")
    cols, rows = herd
    if (cols * rows) % kvh and kvh % (cols * rows):
        raise ValueError(f"a {cols}x{rows} herd does not deal {kvh} KV heads evenly")
    splits = max(1, cols * rows // kvh)

    def params(l, **new):
        return tuple(sorted({**l.param_dict, **new}.items()))

    launches = []
    for l in group.launches:
        if l.op == ATTENTION_OP:
            l = replace(l, params=params(l, herd=(cols, rows), splits=splits))
        elif l.op == "attn_merge":
            l = replace(l, params=params(l, splits=splits))
        launches.append(l)
    partial = {w for l in attn for w in l.writes}
    slots = tuple(replace(s, shape=(s.shape[0], splits) + s.shape[2:]) if s.name in partial else s
                  for s in group.slots)
    out = replace(group, slots=slots, launches=tuple(launches))
    out.validate()
    return out


def price(group: KernelGroup, counts: tuple[LaunchCounts, ...], cal: Calibration) -> GroupEstimate:
    """A group's launches priced in order, decode attention at the attention efficiency."""
    ops = [l.op for l in group.launches]
    if len(ops) != len(counts):
        raise ValueError(f"{group.name}: {len(counts)} counted launches for {len(ops)} declared")
    attention = attention_calibration(cal)
    return GroupEstimate(group.name, tuple(
        LaunchTime(c.name, *launch_time(c.work, attention if op == ATTENTION_OP else cal))
        for c, op in zip(counts, ops)), cal.call_overhead_s)


@dataclass(frozen=True)
class FusedEstimate:
    depth: int                  # live positions (the token's pos is depth - 1)
    capacity: int
    window: int
    group: GroupEstimate
    l3_read: int                # bytes the token's call reads from DDR
    l3_write: int
    attention: dict[str, float]   # its decode-attention launches: seconds, and their compute and DDR time alone

    @property
    def seconds(self) -> float:
        return self.group.seconds

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.seconds


def our_capacity(cfg: LlamaConfig, context: int = OUR_CONTEXT) -> int:
    """The resident cache's positions for `context` (capped at the model's limit), as a session
    with that context builds it."""
    context = min(context, cfg.max_position_embeddings)
    return cache_capacity(cfg, context, min(PREFILL_BUCKET, groups.prefill_buckets(cfg)[-1]))


def fused_group(cfg: LlamaConfig, depth: int, quant: str = "q4nx", window: int | None = None,
                capacity: int | None = None, attention_herd: tuple[int, int] | None = None,
                layer_wide=None) -> KernelGroup:
    """The group a token at live context `depth` runs: `window` given, a cache of `capacity`
    (the window itself when None: the whole-window form); else ours, the staircase's window of
    a cache for `OUR_CONTEXT` (or `capacity`)."""
    if window is None:
        capacity = capacity or our_capacity(cfg)
        window = window_for(depth, capacity)
    capacity = capacity or window
    if not 0 < depth <= window:
        raise ValueError(f"a live context of {depth} positions in a window of {window}")
    g = fused_decode(cfg, capacity, quant, layer_wide, window)
    return with_attention_herd(g, attention_herd) if attention_herd else g


def fused_counts(group: KernelGroup, depth: int) -> tuple[LaunchCounts, ...]:
    """The group's counts for the token at position depth - 1 (cached, `count_cache`)."""
    return cached_counts(group, {group.index("pos"): depth - 1})


def fused_decode_estimate(cfg: LlamaConfig, cal: Calibration, depth: int, quant: str = "q4nx",
                          window: int | None = None, capacity: int | None = None,
                          attention_herd: tuple[int, int] | None = None, layer_wide=None) -> FusedEstimate:
    """One decode token at live context `depth` (see `fused_group` for the window and capacity)."""
    g = fused_group(cfg, depth, quant, window, capacity, attention_herd, layer_wide)
    counts = fused_counts(g, depth)
    attention = attention_calibration(cal)
    parts = [launch_components(c.work, attention) for c, l in zip(counts, g.launches) if l.op == ATTENTION_OP]
    summary = {"seconds": sum(max(p.values()) for p in parts), "compute": sum(p["compute"] for p in parts),
               "l3": sum(p["l3"] for p in parts)}
    return FusedEstimate(depth, g.capacity, g.ctx_len, price(g, counts, cal),
                         sum(c.work.l3_read for c in counts), sum(c.work.l3_write for c in counts), summary)


def weight_bytes(group: KernelGroup) -> int:
    """Bytes of the weights a fused token reads: every static slot, the LM head's among them."""
    return sum(s.nbytes for s in group.with_role(Role.STATIC))


def kv_bytes_per_position(cfg: LlamaConfig) -> int:
    """bf16 K and V of one position in every layer: what a decode token reads per live position."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2


def bytes_bound_tokens_per_s(cfg: LlamaConfig, cal: Calibration, depth: int, quant: str = "q4nx") -> float:
    """The most tokens a second any decode could make at `depth` on this calibration's DDR: the
    weights and the live positions' K and V read once a token, nothing else, no call overhead."""
    g = fused_group(cfg, 1, quant, window=window_for(1, our_capacity(cfg)), capacity=our_capacity(cfg))
    return cal.l3_bandwidth / (weight_bytes(g) + depth * kv_bytes_per_position(cfg))


@dataclass(frozen=True)
class TtftEstimate:
    prompt: int
    bucket: int
    seconds: float
    per_layer: dict[str, GroupEstimate]     # a layer's three groups
    head: GroupEstimate


def resident_ttft(cfg: LlamaConfig, cal: Calibration, prompt: int = PREFILL_BUCKET, quant: str = "q4nx",
                  capacity: int | None = None) -> TtftEstimate:
    """The fused design's prefill: per layer `rms_gemms_rope`, the resident cache's attention
    (its chunk appended, then attended) and `o_ffn` at the prompt's bucket, every layer whole,
    then the LM head on the last row."""
    buckets = groups.prefill_buckets(cfg)
    bucket = next((b for b in buckets if b >= prompt), buckets[-1])
    capacity = capacity or our_capacity(cfg)
    kinds = {"rms_gemms_rope": groups.build_group("rms_gemms_rope", cfg, bucket, quant=quant),
             "flash_attn": resident_flash_attn(cfg, bucket, capacity, window_for(bucket, capacity)),
             "o_ffn": groups.build_group("o_ffn", cfg, bucket, quant=quant)}
    per_layer = {k: estimate_group(g, cal) for k, g in kinds.items()}
    head = estimate_group(groups.lm_head_gemv(cfg, quant), cal)
    total = cfg.num_hidden_layers * sum(e.seconds for e in per_layer.values()) + head.seconds
    return TtftEstimate(prompt, bucket, total, per_layer, head)


def card_decode_seconds(cfg: LlamaConfig, cal: Calibration, quant: str = "q4nx", layer_wide=None) -> float:
    """The layers (card) design's decode token, its 2 calls a layer and the LM head: the NPU's part,
    which does not depend on the context (its attention runs on the host)."""
    from npu_runtime.cost.model import estimate_phases

    return estimate_phases(cfg, cal, 1, quant, layer_wide).decode_token_s


_LAYER = re.compile(r"^L\d+_")
_PARTITION = re.compile(r"_p\d+_")


def format_fused(est: FusedEstimate) -> str:
    """The token's launches summed by kind over the layers: what `make profile` prints of it."""
    by: dict[str, list] = {}
    for l in est.group.launches:
        kind = _PARTITION.sub("_p*_", _LAYER.sub("", l.name))
        row = by.setdefault(kind, [0.0, 0, {}])
        row[0] += l.seconds
        row[1] += 1
        row[2][l.bound] = row[2].get(l.bound, 0) + 1
    lines = [f"{est.group.group} at depth {est.depth}: {est.seconds * 1e3:.2f} ms a token (estimate), "
             f"{est.l3_read / 1e6:.1f} MB read from DDR"]
    for kind, (s, n, bounds) in by.items():
        bound = max(bounds, key=bounds.get)
        lines.append(f"  {kind:<24}{s * 1e3:>10.3f} ms  x{n:<3} {bound}-bound")
    lines.append(f"  {'call overhead':<24}{est.group.call_overhead_s * 1e3:>10.3f} ms")
    return "\n".join(lines)


__all__ = ["ATTENTION_OP", "OUR_CONTEXT", "FusedEstimate", "TtftEstimate", "attention_calibration",
           "bytes_bound_tokens_per_s", "card_decode_seconds", "format_fused", "fused_counts",
           "fused_decode_estimate", "fused_group", "kv_bytes_per_position", "our_capacity", "price",
           "resident_ttft", "weight_bytes", "with_attention_herd"]
