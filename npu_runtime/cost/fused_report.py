"""What the fused decode's calibration says of our design: Llama-3.2-1B decode at 1K to 128K of
live context beside the layers design, the bytes bound and the published anchors, and the
resident prefill's TTFT; the tables `make profile` and the bench print for a fused session.

The targets are reported, not gated: where one is missed, the table says whether the bytes
themselves (the weights and the live positions' bf16 K and V, read once a token at the fitted
DDR bandwidth) are what stands in the way. `python -m npu_runtime.cost.fused_report` prints the
validation (`fused_fit`), this table and the TTFT.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from llama_base.config import LlamaConfig
from npu_runtime.cost.fused import (OUR_CONTEXT, bytes_bound_tokens_per_s, card_decode_seconds, format_fused,
                                    fused_decode_estimate, kv_bytes_per_position, resident_ttft)
from npu_runtime.cost.fused_fit import (FASTFLOWLM_PREFILL_TOK_S, FASTFLOWLM_SOURCE, FASTFLOWLM_TOK_S, K, LLAMA_1B,
                                        QUANT, UPSTREAM_SOURCE, UPSTREAM_TOK_S, UPSTREAM_TTFT_S, solve_decreasing,
                                        calibration_line, ctx_label, fit, validation_report)
from npu_runtime.cost.hardware import FITTED_FUSED, Calibration

# Our design's targets, reported beside its estimate (not gated: a bytes bound may stand in the way)
DECODE_TARGETS = {1 * K: 65.0, 32 * K: 35.0, 128 * K: 13.0}
TTFT_TARGET_S = 0.93
TTFT_PROMPT = 2048
DEPTHS = (1 * K, 2 * K, 8 * K, 32 * K, 128 * K)


@dataclass(frozen=True)
class OurRow:
    depth: int
    window: int
    tokens_per_s: float
    l3_read: int
    bound_tok_s: float          # the weights and live K/V once a token at the fitted DDR bandwidth
    card_tok_s: float           # the layers design's NPU calls (its host attention not priced)
    card_with_kv_tok_s: float   # and its host reading the live K/V at that bandwidth
    target: float | None

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.tokens_per_s >= self.target

    @property
    def bound_blocks(self) -> bool:
        """The target is above what the bytes allow at this bandwidth, whatever the design."""
        return self.target is not None and self.bound_tok_s < self.target


def our_rows(cal: Calibration, cfg: LlamaConfig = LLAMA_1B, quant: str = QUANT, depths=DEPTHS,
             layer_wide=None, capacity: int | None = None, targets: bool = True) -> list[OurRow]:
    """`targets`: give each depth Llama-3.2-1B Q4NX's target (for that model only)."""
    card = card_decode_seconds(cfg, cal, quant, layer_wide)
    out = []
    for d in depths:
        e = fused_decode_estimate(cfg, cal, d, quant, capacity=capacity, layer_wide=layer_wide)
        host_kv = d * kv_bytes_per_position(cfg) / cal.l3_bandwidth
        out.append(OurRow(d, e.window, e.tokens_per_s, e.l3_read, bytes_bound_tokens_per_s(cfg, cal, d, quant),
                          1 / card, 1 / (card + host_kv), DECODE_TARGETS.get(d) if targets else None))
    return out


def our_report(cal: Calibration, cfg: LlamaConfig = LLAMA_1B, quant: str = QUANT, depths=DEPTHS,
               layer_wide=None, capacity: int | None = None, anchors: bool = True) -> str:
    """Our fused decode at each depth beside the layers design and, for Llama-3.2-1B Q4NX, the
    published anchors; the targets and, where one is out of the bytes' reach, that bound."""
    rows = our_rows(cal, cfg, quant, depths, layer_wide, capacity, targets=anchors)
    head = f"{'depth':>6}{'window':>8}{'fused':>10}{'bound':>10}{'layers':>10}{'+host KV':>10}"
    if anchors:
        head += f"{'upstream':>10}{'FFLM':>7}"
    lines = [f"decode tok/s (estimates on NPU2 at {cal.l3_bandwidth / 1e9:.1f} GB/s; bound = weights + live K/V "
             f"once a token; layers = the card design's NPU calls, + host KV its host attention's bytes)",
             head + ("  target" if anchors else "")]
    for r in rows:
        line = (f"{ctx_label(r.depth):>6}{ctx_label(r.window):>8}{r.tokens_per_s:>10.1f}{r.bound_tok_s:>10.1f}"
                f"{r.card_tok_s:>10.1f}{r.card_with_kv_tok_s:>10.1f}")
        if anchors:
            line += f"{UPSTREAM_TOK_S.get(r.depth, float('nan')):>10.2f}{FASTFLOWLM_TOK_S.get(r.depth, float('nan')):>7.1f}"
        if r.target is not None:
            verdict = "met" if r.met else ("missed: the bytes bound is below it" if r.bound_blocks else "missed")
            line += f"  >= {r.target:g}: {verdict}"
        lines.append(line)
    if anchors:
        lines.append(f"anchors: {UPSTREAM_SOURCE} (whole-window builds); FFLM: {FASTFLOWLM_SOURCE}")
    return "\n".join(lines)


def gemm_efficiency_for_ttft(cal: Calibration, target_s: float = TTFT_TARGET_S, cfg: LlamaConfig = LLAMA_1B,
                             quant: str = QUANT, prompt: int = TTFT_PROMPT) -> float | None:
    """The GEMM efficiency at which the resident prefill's TTFT would be `target_s` (the one
    constant it moves with: its products are compute-bound), None if no efficiency up to the
    peak reaches it."""
    def ttft(e: float) -> float:
        return resident_ttft(cfg, replace(cal, gemm_efficiency=e), prompt, quant).seconds
    try:
        return solve_decreasing(ttft, target_s, 0.01, 1.0)
    except ValueError:
        return None


def ttft_report(cal: Calibration, cfg: LlamaConfig = LLAMA_1B, quant: str = QUANT, prompt: int = TTFT_PROMPT,
                anchors: bool = True, capacity: int | None = None) -> str:
    t = resident_ttft(cfg, cal, prompt, quant, capacity)
    parts = ", ".join(f"{k} {e.seconds * 1e3:.1f} ms" for k, e in t.per_layer.items())
    line = (f"TTFT at {t.prompt} (bucket {t.bucket}): {t.seconds:.3f} s estimated "
            f"({cfg.num_hidden_layers} layers of {parts}; LM head {t.head.seconds * 1e3:.1f} ms)")
    if anchors:
        line += (f"\n  upstream {UPSTREAM_TTFT_S:.3f} s (its prefill on bf16 copies of the weights), FFLM "
                 f"{prompt / FASTFLOWLM_PREFILL_TOK_S.get(prompt, float('nan')):.3f} s; target <= {TTFT_TARGET_S} s: ")
        if t.seconds <= TTFT_TARGET_S:
            line += "met"
        else:
            need = gemm_efficiency_for_ttft(cal, TTFT_TARGET_S, cfg, quant, prompt)
            line += (f"missed: no bytes bound, the prefill's products are compute-bound at the card fit's GEMM "
                     f"efficiency {cal.gemm_efficiency:.2f}"
                     + (f"; it would be met from {need:.2f}" if need else ""))
    return line


def _is_llama_1b(cfg: LlamaConfig) -> bool:
    """Whether `cfg` has Llama-3.2-1B's shapes, the model the anchors were measured on."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size")
    return all(getattr(cfg, k) == getattr(LLAMA_1B, k) for k in keys)


def table_depths(cfg: LlamaConfig) -> tuple[int, ...]:
    """`DEPTHS` the model's context holds; its largest power of two when it holds none of them."""
    limit = min(OUR_CONTEXT, cfg.max_position_embeddings)
    return tuple(d for d in DEPTHS if d <= limit) or (1 << (limit.bit_length() - 1),)


def session_report(cfg: LlamaConfig, quant: str, layer_wide, capacity: int, prompt: int, depth: int,
                   cal: Calibration = FITTED_FUSED) -> str:
    """What `make profile` prints for a fused session: this run's last token at its depth in
    its own cache, the table of our design at 1K..128K (beside the anchors when the model and
    format are theirs), the resident prefill's TTFT at the prompt's bucket."""
    anchors = _is_llama_1b(cfg) and quant == QUANT
    depth = max(1, min(depth, capacity))
    token = fused_decode_estimate(cfg, cal, depth, quant, capacity=capacity, layer_wide=layer_wide)
    ttft = resident_ttft(cfg, cal, prompt, quant, capacity)
    lines = [format_fused(token), calibration_line(cal),
             our_report(cal, cfg, quant, table_depths(cfg), layer_wide, anchors=anchors)]
    if anchors:
        lines.append(ttft_report(cal, cfg, quant, TTFT_PROMPT, anchors=True))
    lines.append(f"estimated on NPU2: TTFT {ttft.seconds * 1e3:.1f} ms at this prompt's bucket ({ttft.bucket}), "
                 f"decode {token.tokens_per_s:.1f} tok/s at this run's depth ({depth}, window {token.window})")
    return "\n".join(lines)


def bench_estimate(cfg: LlamaConfig, lengths: tuple[int, ...], quant: str, cal: Calibration = FITTED_FUSED) -> dict:
    """The bench's NPU estimate of a fused session: the resident prefill's TTFT at each prompt
    length, and per depth our decode, the bytes bound, the layers design and the anchors."""
    anchors = _is_llama_1b(cfg) and quant == QUANT
    rows = our_rows(cal, cfg, quant, table_depths(cfg), targets=anchors)
    return {
        "decode": "fused",
        "ttft_s": {str(n): resident_ttft(cfg, cal, n, quant).seconds for n in lengths},
        "decode_tok_s": rows[0].tokens_per_s,
        "depths": [{"depth": r.depth, "window": r.window, "tok_s": r.tokens_per_s, "bound_tok_s": r.bound_tok_s,
                    "layers_tok_s": r.card_tok_s, "target": r.target, "bound_blocks": r.bound_blocks,
                    **({"upstream_tok_s": UPSTREAM_TOK_S.get(r.depth), "fastflowlm_tok_s": FASTFLOWLM_TOK_S.get(r.depth)}
                       if anchors else {})} for r in rows],
        "calibration": calibration_line(cal),
        "anchors": f"anchors: {UPSTREAM_SOURCE} (whole-window builds); {FASTFLOWLM_SOURCE}" if anchors else None,
    }


def report(cal: Calibration | None = None) -> str:
    cal = cal or fit()
    return "\n\n".join([validation_report(cal), our_report(cal), ttft_report(cal)])


if __name__ == "__main__":
    print(report())
