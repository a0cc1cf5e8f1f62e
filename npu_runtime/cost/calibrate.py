"""The cost model's three fitted constants, the published NPU2 figures they are fitted to, and the
model's error against every published point.

Sources (Xilinx/mlir-air `programming_examples/llms`, measured on NPU2, bf16, 2048-token prompts):
- `README.md` ("Performance"): Llama-3.2-1B 1.21 s TTFT, 12.2 tok/s decode with 3 prefill / 2
  decode ELFs per layer (this project's design); SmolLM2-1.7B 2.02 s, 8.0 tok/s (same 3 / 2 form);
  Llama-3.2-3B 3.70 s, 4.7 tok/s (3 prefill ELFs but head_dim 128 with a host transpose, and a
  5-ELF decode: only its prefill is the same form, and even that only roughly).
- `llama32_1b/docs/profile.md` (an earlier build of the same design: 1.27 s, 92 ms/token): per
  call, o_ffn 41.0 ms, flash_attn 21.6 ms, rms_gemms_rope 7.3 ms, lm_head_gemv 13.6 ms (its TTFT
  uses the decode LM head for the last row, as this project does), o_gemv_ffn 3.6 ms,
  rms_gemv_rope 0.9 ms.

The fit is a least-squares fit of log(model / published) over the Llama-3.2-1B points only
(`FIT_POINTS`); SmolLM2-1.7B and Llama-3.2-3B are held out and their errors are a test of the
model, not of the fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from llama_base import group_contract
from llama_base.config import LLAMA_3_2_1B, LLAMA_3_2_3B, LlamaConfig
from npu_runtime.cost.hardware import (BF16_MACS_PER_CYCLE, CHANNEL_BYTES_PER_CYCLE, CLOCK_HZ, CORE_CHANNELS,
                                       DMA_TRANSFER_CYCLES, MEMTILE_CHANNELS, SHIM_CHANNELS_PER_COLUMN,
                                       VECTOR_LANES, Calibration)
from npu_runtime.cost.model import estimate_phases, group_counts, phase_groups

PROMPT = 2048
LLAMA_1B = LLAMA_3_2_1B
SMOLLM2_1_7B = LlamaConfig(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                           head_dim=64, intermediate_size=8192, vocab_size=49152, rope_scaling=None)


@dataclass(frozen=True)
class Published:
    label: str
    model: str
    what: str           # "ttft", "decode" (seconds per token) or a group kind (seconds per call)
    seconds: float
    fitted: bool        # part of the fit, or held out


PUBLISHED = (
    Published("Llama-3.2-1B TTFT @2048", "llama-3.2-1b", "ttft", 1.21, True),
    Published("Llama-3.2-1B decode (12.2 tok/s)", "llama-3.2-1b", "decode", 1 / 12.2, True),
    Published("Llama-3.2-1B o_ffn @2048", "llama-3.2-1b", "o_ffn", 41.0e-3, True),
    Published("Llama-3.2-1B flash_attn @2048", "llama-3.2-1b", "flash_attn", 21.6e-3, True),
    Published("Llama-3.2-1B rms_gemms_rope @2048", "llama-3.2-1b", "rms_gemms_rope", 7.3e-3, True),
    Published("Llama-3.2-1B lm_head_gemv", "llama-3.2-1b", "lm_head_gemv", 13.6e-3, True),
    Published("Llama-3.2-1B o_gemv_ffn", "llama-3.2-1b", "o_gemv_ffn", 3.6e-3, True),
    Published("Llama-3.2-1B rms_gemv_rope", "llama-3.2-1b", "rms_gemv_rope", 0.9e-3, True),
    Published("SmolLM2-1.7B TTFT @2048", "smollm2-1.7b", "ttft", 2.02, False),
    Published("SmolLM2-1.7B decode (8.0 tok/s)", "smollm2-1.7b", "decode", 1 / 8.0, False),
    Published("Llama-3.2-3B TTFT @2048 (head_dim 128)", "llama-3.2-3b", "ttft", 3.70, False),
    Published("Llama-3.2-3B decode (4.7 tok/s)", "llama-3.2-3b", "decode", 1 / 4.7, False),
)
CONFIGS = {"llama-3.2-1b": LLAMA_1B, "smollm2-1.7b": SMOLLM2_1_7B, "llama-3.2-3b": LLAMA_3_2_3B}


def _terms(cfg: LlamaConfig) -> dict[str, list[tuple[float, ...]]]:
    """Per group kind, per launch: the parts of `model.launch_time` that do not depend on the
    calibration (so a grid of calibrations is evaluated with numpy)."""
    channel = CHANNEL_BYTES_PER_CYCLE * CLOCK_HZ
    transfer = DMA_TRANSFER_CYCLES / CLOCK_HZ
    out = {}
    for kind, g in phase_groups(cfg, PROMPT).items():
        rows = []
        for c in group_counts(g):
            w, cols = c.work, max(c.work.columns, 1)
            rows.append((w.core_macs / (BF16_MACS_PER_CYCLE * CLOCK_HZ), w.core_vector / (VECTOR_LANES * CLOCK_HZ),
                         w.l3_read + w.l3_write, cols * SHIM_CHANNELS_PER_COLUMN * channel,
                         w.l3_dmas * transfer / (cols * SHIM_CHANNELS_PER_COLUMN),
                         max(w.l2_l1 / (cols * MEMTILE_CHANNELS * channel) + w.l2_dmas * transfer / (cols * MEMTILE_CHANNELS),
                             w.core_dma_bytes / (CORE_CHANNELS * channel))))
        out[kind] = rows
    return out


def _group_seconds(rows, eff, bw, call):
    t = call
    for macs, vec, l3, cap, l3x, fixed in rows:
        compute = macs / eff + vec
        l3t = l3 / np.minimum(bw, cap) + l3x
        t = t + np.maximum(np.maximum(compute, l3t), fixed)
    return t


def _predict(terms, cfg: LlamaConfig, what: str, eff, bw, call):
    g = {k: _group_seconds(rows, eff, bw, call) for k, rows in terms.items()}
    n = cfg.num_hidden_layers
    if what == "ttft":
        return n * sum(g[k] for k in group_contract.PREFILL_KINDS) + g["lm_head_gemv"]
    if what == "decode":
        return n * sum(g[k] for k in group_contract.DECODE_KINDS) + g["lm_head_gemv"]
    return g[what]


@lru_cache(maxsize=1)
def fit() -> Calibration:
    """The calibration minimising the squared log error over the fitted points (a grid search:
    the model is a max of terms, not smooth, and three constants are cheap to grid)."""
    eff = np.geomspace(0.02, 1.0, 50)[:, None, None]
    bw = np.geomspace(5e9, 400e9, 80)[None, :, None]
    call = np.linspace(0.0, 2e-3, 81)[None, None, :]
    err = 0.0
    terms = {m: _terms(cfg) for m, cfg in CONFIGS.items() if any(p.fitted and p.model == m for p in PUBLISHED)}
    for p in PUBLISHED:
        if p.fitted:
            err = err + np.log(_predict(terms[p.model], CONFIGS[p.model], p.what, eff, bw, call) / p.seconds) ** 2
    i, j, k = np.unravel_index(np.argmin(err), err.shape)
    return Calibration(float(eff[i, 0, 0]), float(bw[0, j, 0]), float(call[0, 0, k]))


CALIBRATION_NOTE = "fitted to upstream mlir-air's published Llama-3.2-1B bf16 NPU2 figures"


@dataclass(frozen=True)
class PointError:
    point: Published
    model_seconds: float

    @property
    def error(self) -> float:
        """Relative error of the model: (model - published) / published."""
        return self.model_seconds / self.point.seconds - 1


def errors(cal: Calibration | None = None) -> list[PointError]:
    cal = cal or fit()
    out = []
    for p in PUBLISHED:
        cfg = CONFIGS[p.model]
        est = estimate_phases(cfg, cal, PROMPT)
        s = {"ttft": est.ttft_s, "decode": est.decode_token_s}.get(p.what)
        out.append(PointError(p, s if s is not None else est.groups[p.what].seconds))
    return out


def report(cal: Calibration | None = None) -> str:
    cal = cal or fit()
    lines = [f"calibration ({CALIBRATION_NOTE}): GEMM efficiency {cal.gemm_efficiency:.2f} of the bf16 peak, "
             f"L3 bandwidth {cal.l3_bandwidth / 1e9:.1f} GB/s, {cal.call_overhead_s * 1e3:.3f} ms per group call",
             f"{'published point':<42}{'published':>11}{'model':>11}{'error':>8}  "]
    for e in errors(cal):
        unit = 1 if e.point.what == "ttft" else 1e3
        fmt = (lambda v: f"{v:.3f} s") if unit == 1 else (lambda v: f"{v * 1e3:.2f} ms")
        lines.append(f"{e.point.label:<42}{fmt(e.point.seconds):>11}{fmt(e.model_seconds):>11}{e.error:>+8.1%}  "
                     f"{'fitted' if e.point.fitted else 'held out'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
