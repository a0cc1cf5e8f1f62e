"""Time per launch, per group call and per phase, from what the modules move and compute.

A launch takes as long as its slowest resource, assuming the double-buffered DMAs overlap
compute (what the ping-pong buffers are for): the busiest core's contractions at the bf16 peak
times the fitted efficiency plus its elementwise work; L3 traffic at the fitted DDR bandwidth
(capped by the shim channels of the columns the launch uses); memory-tile traffic over the
memory tiles' channels; and the busiest core's own two DMA channels. Each transfer also costs
`DMA_TRANSFER_CYCLES` on its channel. A group call adds the fitted per-call overhead.

TTFT is one prefill at the prompt's bucket (three group calls per layer) plus the LM head;
a decode token is two group calls per layer plus the LM head. Host work between calls is
inside the per-call overhead: the model estimates the NPU path, it measures nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from kernel_builder import groups

from llama_base import group_contract
from llama_base.group_contract import KernelGroup
from llama_base.config import LlamaConfig
from npu_runtime.cost.count_cache import cached_counts
from npu_runtime.cost.counts import LaunchCounts, Work
from npu_runtime.cost.hardware import (BF16_MACS_PER_CYCLE, CHANNEL_BYTES_PER_CYCLE, CLOCK_HZ, CORE_CHANNELS,
                                       DMA_TRANSFER_CYCLES, MEMTILE_CHANNELS, SHIM_CHANNELS_PER_COLUMN,
                                       VECTOR_LANES, Calibration)


@dataclass(frozen=True)
class LaunchTime:
    name: str
    seconds: float
    bound: str          # the resource that sets it: compute, l3, memtile, core-dma


def launch_time(work: Work, cal: Calibration) -> tuple[float, str]:
    times = launch_components(work, cal)
    bound = max(times, key=times.get)
    return times[bound], bound


def launch_components(work: Work, cal: Calibration) -> dict[str, float]:
    """Seconds each resource needs for the launch's work; the launch takes the largest."""
    cols = max(work.columns, 1)
    channel = CHANNEL_BYTES_PER_CYCLE * CLOCK_HZ
    transfer = DMA_TRANSFER_CYCLES / CLOCK_HZ
    shim_rate = min(cal.l3_bandwidth, cols * SHIM_CHANNELS_PER_COLUMN * channel)
    times = {
        "compute": work.core_macs / (BF16_MACS_PER_CYCLE * CLOCK_HZ * cal.gemm_efficiency)
                   + work.core_vector / (VECTOR_LANES * CLOCK_HZ),
        "l3": (work.l3_read + work.l3_write) / shim_rate + work.l3_dmas * transfer / (cols * SHIM_CHANNELS_PER_COLUMN),
        "memtile": (work.l2_l1 / (cols * MEMTILE_CHANNELS * channel)
                    + work.l2_dmas * transfer / (cols * MEMTILE_CHANNELS)),
        "core-dma": work.core_dma_bytes / (CORE_CHANNELS * channel),
    }
    return times


@dataclass(frozen=True)
class GroupEstimate:
    group: str
    launches: tuple[LaunchTime, ...]
    call_overhead_s: float

    @property
    def seconds(self) -> float:
        return sum(l.seconds for l in self.launches) + self.call_overhead_s


def estimate_counts(name: str, counts: list[LaunchCounts], cal: Calibration) -> GroupEstimate:
    return GroupEstimate(name, tuple(LaunchTime(c.name, *launch_time(c.work, cal)) for c in counts),
                         cal.call_overhead_s)


def group_counts(group: KernelGroup, q_start: int = 0) -> tuple[LaunchCounts, ...]:
    """The counts of a group's stitched module with every i32 scalar at `q_start` (cached in
    memory and on disk, `count_cache`: a module takes up to seconds to build)."""
    return cached_counts(group, {i: q_start for i, s in enumerate(group.slots) if s.dtype == "i32"})


def estimate_group(group: KernelGroup, cal: Calibration, q_start: int = 0) -> GroupEstimate:
    return estimate_counts(group.name, list(group_counts(group, q_start)), cal)


@dataclass(frozen=True)
class PhaseEstimate:
    ttft_s: float
    decode_token_s: float
    groups: dict[str, GroupEstimate]

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.decode_token_s


def phase_groups(cfg: LlamaConfig, prompt: int, quant: str = "bf16", wide=frozenset()) -> dict[str, KernelGroup]:
    """The groups one prefill of `prompt` tokens (at its bucket) and one decode step call, in a
    layer that keeps the weights `wide` in bf16."""
    bucket = next((b for b in groups.prefill_buckets(cfg) if b >= prompt), groups.prefill_buckets(cfg)[-1])
    kinds = [(k, bucket) for k in group_contract.PREFILL_KINDS] + [(k, 1) for k in group_contract.DECODE_KINDS + ("lm_head_gemv",)]
    return {k: groups.build_group(k, cfg, s, quant=quant, wide=wide) for k, s in kinds}


def estimate_phases(cfg: LlamaConfig, cal: Calibration, prompt: int, quant: str = "bf16",
                    layer_wide=None) -> PhaseEstimate:
    """TTFT and a decode step, every layer's groups summed. `layer_wide`: each layer's weights
    held in bf16 (`DeviceModel.layer_wide`), uniform when None; `groups` are the estimates of the
    variant most layers run."""
    layer_wide = list(layer_wide) if layer_wide is not None else [frozenset()] * cfg.num_hidden_layers
    by_wide = {w: {k: estimate_group(g, cal) for k, g in phase_groups(cfg, prompt, quant, w).items()}
               for w in dict.fromkeys(layer_wide)}
    head = next(iter(by_wide.values()))["lm_head_gemv"].seconds
    ttft = sum(by_wide[w][k].seconds for w in layer_wide for k in group_contract.PREFILL_KINDS) + head
    decode = sum(by_wide[w][k].seconds for w in layer_wide for k in group_contract.DECODE_KINDS) + head
    return PhaseEstimate(ttft, decode, by_wide[max(by_wide, key=layer_wide.count)])


def format_group(est: GroupEstimate) -> str:
    """One line per launch and a total: what `make profile DEVICE=interp` prints."""
    lines = [f"{est.group}: {est.seconds * 1e3:.3f} ms per call (estimate)"]
    for l in est.launches:
        lines.append(f"  {l.name:<24}{l.seconds * 1e3:>10.3f} ms  {l.bound}-bound")
    lines.append(f"  {'call overhead':<24}{est.call_overhead_s * 1e3:>10.3f} ms")
    return "\n".join(lines)


__all__ = ["GroupEstimate", "LaunchTime", "PhaseEstimate", "estimate_counts", "estimate_group", "estimate_phases",
           "format_group", "group_counts", "launch_components", "launch_time", "phase_groups"]
