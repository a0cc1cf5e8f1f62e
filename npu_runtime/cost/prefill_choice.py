"""Where a Q4NX prefill should dequantize its weights on the NPU, priced by the cost model.

A prefill projection multiplies every weight by every row of the prompt, so a 4-bit weight has
to become bf16 somewhere before the bf16 product. Three places, each a design an NPU LLM runtime
has used:

- **fused** (what the builders emit, `gemm_q4nx`): each core expands its Q4NX W tile in L1 just
  before the product. W moves as 5/16 of bf16's bytes, but the expansion is repeated by every
  core that shares the tile and for every block of rows: one elementwise operation per weight
  per `tile_m` rows, on the vector unit beside the products.
- **per call**: a launch expands the whole matrix into a bf16 scratch in DDR, then the bf16 GEMM
  reads it. The expansion happens once per call; the GEMM re-reads bf16 panels.
- **at load** (upstream mlir-air's `llama32_1b_q4nx` prefill): the host expands the weights once
  and the prefill keeps bf16 copies of them resident beside the Q4NX ones decode streams. No
  expansion on the NPU at all, at the price of the bf16 bytes in memory.

Fused and the bf16 GEMM are the built modules' counts (`model.estimate_group`); the per-call
expansion is a closed form (`dequant_work`), since no builder emits it. All three are priced
with the fitted constants and with the cores' GEMM efficiency scaled, because that one constant
decides between them: fused trades L3 bytes for core work, so on long prompts it loses while
the cores are as slow as fitted and wins as soon as they are faster. `python -m npu_runtime.cost.prefill_choice`
prints the comparison docs/profile.md quotes.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from llama_base import group_contract
from kernel_builder.backend_presets import ARRAY_COLS, ARRAY_ROWS, BF16
from llama_base import q4nx
from llama_base.config import LlamaConfig
from npu_runtime.cost.counts import Work
from npu_runtime.cost.hardware import FITTED, Calibration
from npu_runtime.cost.model import estimate_phases, launch_components, phase_groups

CHOICES = ("fused", "per call", "at load")
# The cores' GEMM efficiency relative to the fitted one: the fit rests on one design's
# published times and is the model's least certain constant (docs/profile.md, the cost model).
EFFICIENCY_SCALES = (1.0, 1.5, 2.0)


def dequant_work(n: int, k: int) -> Work:
    """One launch expanding a Q4NX [n, k] matrix to bf16 in DDR on every core of the array: the
    Q4NX bytes in, the bf16 bytes out, one elementwise operation per weight, one transfer per
    block each way."""
    cores = ARRAY_COLS * ARRAY_ROWS
    weights, packed = n * k, q4nx.nbytes(n, k)
    blocks = -(-n // q4nx.ROWS) * -(-k // q4nx.COLS)
    return Work(l3_read=packed, l3_write=weights * BF16, l3_dmas=2 * blocks, vector=weights,
                core_vector=-(-weights // cores), core_dma_bytes=-(-(packed + weights * BF16) // cores),
                cores=cores, columns=ARRAY_COLS)


def projections(group: group_contract.KernelGroup) -> dict[int, tuple[int, int]]:
    """The group's weight products: launch index → (N, K) of W."""
    return {i: (l.p("N"), l.p("K")) for i, l in enumerate(group.launches) if l.op in ("gemm", "gemm_q4nx")}


@dataclass(frozen=True)
class PrefillChoice:
    choice: str
    ttft_s: float           # one prefill at the prompt's bucket plus the LM head, as model.estimate_phases
    projection_s: float     # of which the layers' weight products (and, per call, their expansion)
    extra_bytes: int        # weight bytes the choice holds beyond the Q4NX ones decode streams


def compare(cfg: LlamaConfig, prompt: int, cal: Calibration = FITTED) -> dict[str, PrefillChoice]:
    """The three choices' TTFT for one prompt. Decode reads Q4NX in all three, and so does the LM
    head that ends a prefill."""
    built = {q: phase_groups(cfg, prompt, q) for q in ("q4nx", "bf16")}
    est = {q: estimate_phases(cfg, cal, prompt, q) for q in built}
    layers = cfg.num_hidden_layers

    def products(q: str) -> float:
        """Seconds a prefill spends in its layers' weight products."""
        return layers * sum(est[q].groups[kind].launches[i].seconds
                            for kind in group_contract.PREFILL_KINDS for i in projections(built[q][kind]))

    shapes = [nk for kind in group_contract.PREFILL_KINDS for nk in projections(built["q4nx"][kind]).values()]
    expand = layers * sum(max(launch_components(dequant_work(n, k), cal).values()) for n, k in shapes)
    head = est["q4nx"].groups["lm_head_gemv"].seconds
    prefill_bf16 = est["bf16"].ttft_s - est["bf16"].groups["lm_head_gemv"].seconds
    return {
        "fused": PrefillChoice("fused", est["q4nx"].ttft_s, products("q4nx"), 0),
        "per call": PrefillChoice("per call", prefill_bf16 + expand + head, products("bf16") + expand,
                                  max(n * k for n, k in shapes) * BF16),
        "at load": PrefillChoice("at load", prefill_bf16 + head, products("bf16"),
                                 layers * sum(n * k for n, k in shapes) * BF16),
    }


def report(cfg: LlamaConfig, prompts: tuple[int, ...] = (128, 2048), cal: Calibration = FITTED) -> str:
    """TTFT of each choice per prompt and GEMM efficiency, and the bytes each holds beyond Q4NX."""
    lines = ["| GEMM efficiency | prompt | " + " | ".join(f"{c}: TTFT (products)" for c in CHOICES) + " |",
             "|---" * (2 + len(CHOICES)) + "|"]
    extra = None        # the bytes each choice holds depend on neither the prompt nor the rates
    for scale in EFFICIENCY_SCALES:
        c = replace(cal, gemm_efficiency=cal.gemm_efficiency * scale)
        for prompt in prompts:
            res = compare(cfg, prompt, c)
            extra = extra or res
            best = min(res.values(), key=lambda r: r.ttft_s).choice
            cells = [f"{'**' if r.choice == best else ''}{r.ttft_s * 1e3:.0f} ms ({r.projection_s * 1e3:.0f})"
                     f"{'**' if r.choice == best else ''}" for r in res.values()]
            lines.append(f"| {c.gemm_efficiency:.2f} | {prompt} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("weights held beyond Q4NX: " + ", ".join(f"{r.choice} {r.extra_bytes / 2**20:.0f} MiB"
                                                         for r in extra.values()))
    return "\n".join(lines)


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(p) for p in text.split(","))
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of prompt lengths")
    return lengths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=(128, 2048), type=_lengths, help="prompt lengths, comma-separated")
    args = ap.parse_args(argv)
    print(report(LlamaConfig(), args.prompts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
