"""Ranking GEMV tilings by the cost model, legal or not, with the rules each one breaks; and
the Q4NX GEMM tilings the builder accepts.

A candidate is a herd width (cores in one array row), rows per L1 slab (`tile_m`) and columns
per slab (`tile_k`, dividing K; K itself is no split). Its work is what `kernel_builder.mlir.gemv`
emits for it: x once per core (whole, so a K step moves only W), one DMA of W per slab and K
step, one output DMA per slab; with a split, the f32 partial sums stay in L1, the accumulating
kernel reads and rewrites them on every call, and one pass per slab rounds them to bf16. It is
counted in closed form so that candidates the builder refuses can be costed too;
`tests/test_cost_model.py` holds the closed form to the walker's count of the built module
wherever the builder accepts the candidate.

L1 is counted as the rules count it (`backend_presets.gemv_l1_bytes`, the validator's count of
the built module): the compiler ping-pongs every buffer a DMA fills or drains inside a loop, so
a slab always takes twice its size and its DMA always overlaps compute. A single-buffered slab
is not something the toolchain builds, so it is not a candidate.

Candidates that move the same bytes differ only in their number of transfers (W per K step,
the output per slab), which the model prices at an assumed `DMA_TRANSFER_CYCLES` each, and in
core work the DMAs hide. The ranking's order among those is therefore within a fraction of a
percent and rests on that assumption; `gemv_margin` says how far a tiling is from the best,
and `MARGIN` / `MARGIN_S` bound what the model tells apart.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernel_builder.backend_presets import (ARRAY_COLS, BF16, L1_BUDGET, gemv_l1_bytes, q4nx_gemm_herds, q4nx_k_steps,
                                            q4nx_tile_ns)
from llama_base.group_contract import Launch, Role, Slot
from kernel_builder.hw_rules import WORD
from kernel_builder.mlir import KernelShapeError, gemm_q4nx
from npu_runtime.cost.counts import Work, count_module
from npu_runtime.cost.hardware import FITTED, Calibration
from npu_runtime.cost.model import launch_components


# Below either of these, two GEMV tilings are a tie as far as the model can tell: their
# difference is a few transfers at the assumed `DMA_TRANSFER_CYCLES`, or (on a tiny GEMV) a
# thousandth of the fitted per-call overhead that every launch sits inside.
MARGIN = 0.01
MARGIN_S = FITTED.call_overhead_s / 1000


@dataclass(frozen=True)
class GemvCandidate:
    cores: int
    tile_m: int
    tile_k: int
    seconds: float
    bound: str                  # the resource that sets the time (model.launch_components' keys)
    l1_bytes: int
    broken: tuple[str, ...]     # the NPU rules it breaks; empty if the NPU would accept it

    @property
    def legal(self) -> bool:
        return not self.broken

    def describe(self, k: int) -> str:
        split = f"{self.tile_k} columns (K in {k // self.tile_k} steps)" if self.tile_k < k else "full K"
        return f"{self.cores} cores, {self.tile_m} rows x {split}"


def gemv_work(m: int, k: int, cores: int, tile_m: int, tile_k: int | None = None) -> Work:
    tk = tile_k or k
    slabs = m // tile_m
    per_core_rows = m // cores
    steps = k // tk
    split = tk < k
    # per output row with a split: its f32 sum read and rewritten by each K step's call, then rounded
    sums = m * (steps + 1) if split else 0
    return Work(l3_read=(m * k + cores * k) * BF16, l3_write=m * BF16, l3_dmas=cores + slabs * (steps + 1),
                macs=m * k, core_macs=per_core_rows * k,
                vector=sums, core_vector=sums // cores,
                core_dma_bytes=(k + per_core_rows * (k + 1)) * BF16, cores=cores, columns=cores)


def gemv_candidate(m: int, k: int, cores: int, tile_m: int, tile_k: int | None = None,
                   cal: Calibration = FITTED) -> GemvCandidate:
    """One tiling, timed by the model, with its L1 as the rules count it and the rules it breaks."""
    tk = tile_k or k
    l1 = gemv_l1_bytes(tile_m, k, tk)
    broken = []
    if l1 > L1_BUDGET:
        broken.append(f"L1 {l1} B > {L1_BUDGET} B")
    if tile_m * BF16 % WORD:
        broken.append(f"{tile_m * BF16}-byte output DMAs (not whole 32-bit words)")
    if tk < k and tk * BF16 % WORD:
        broken.append(f"{tk * BF16}-byte runs of W (not whole 32-bit words)")
    parts = launch_components(gemv_work(m, k, cores, tile_m, tk), cal)
    bound = max(parts, key=parts.get)
    return GemvCandidate(cores, tile_m, tk, parts[bound], bound, l1, tuple(broken))


def gemv_candidates(m: int, k: int, cal: Calibration = FITTED) -> list[GemvCandidate]:
    """Every (cores, tile_m, tile_k) that splits `m` and `k` evenly, fastest first (legal first on a tie)."""
    out = []
    for cores in (c for c in range(ARRAY_COLS, 0, -1) if m % c == 0):
        per_core = m // cores
        for tm in (t for t in range(1, per_core + 1) if per_core % t == 0):
            for tk in (t for t in range(k, 0, -1) if k % t == 0):
                out.append(gemv_candidate(m, k, cores, tm, tk, cal))
    return sorted(out, key=lambda c: (c.seconds, not c.legal))


def best_gemv(m: int, k: int, cal: Calibration = FITTED) -> GemvCandidate | None:
    """The fastest candidate the NPU would accept, or None when none is."""
    return next((c for c in gemv_candidates(m, k, cal) if c.legal), None)


def gemv_margin(tiling: dict, cal: Calibration = FITTED) -> tuple[float, float]:
    """How much slower the model finds `tiling` (a `backend_presets.gemv_tiling` dict) than the
    best legal candidate of its shape, relative and in seconds: (0.0, 0.0) when it is the best."""
    m, k = tiling["M"], tiling["K"]
    best = best_gemv(m, k, cal)
    mine = gemv_candidate(m, k, tiling["herd"][0] * tiling["herd"][1], tiling["tile_m"], tiling["tile_k"], cal)
    return mine.seconds / best.seconds - 1.0, mine.seconds - best.seconds


@dataclass(frozen=True)
class GemmCandidate:
    m_axis: int                 # the herd dimension prompt rows walk (gemm.py)
    herd: tuple[int, int]
    tile_m: int
    tile_n: int
    tile_k_l2: int
    seconds: float
    bound: str


def gemm_q4nx_candidates(m: int, n: int, k: int, tile_k: int = 64, cal: Calibration = FITTED) -> list[GemmCandidate]:
    """Every Q4NX GEMM tiling the builder accepts (both orientations, `tile_m` up to 64, every
    whole-row-block `tile_n` and K step), timed from the count of the module it emits; fastest
    first. Built rather than counted in closed form: the builder's L1 and L2 checks are the
    legality, and a GEMM's walk has more shapes than a closed form would be worth keeping."""
    slots = [Slot("a", (m, k), "bf16", Role.INPUT), Slot("w", (n, k), "q4nx", Role.STATIC),
             Slot("c", (m, n), "bf16", Role.OUTPUT)]
    out = []
    for m_axis, along_m, hn, herd in q4nx_gemm_herds(n):
        per_core = m // along_m
        for tm in (t for t in range(1, min(per_core, 64) + 1) if per_core % t == 0):
            for tn in reversed(q4nx_tile_ns(n, hn)):
                for tk2 in q4nx_k_steps(k, tile_k):
                    params = dict(M=m, N=n, K=k, herd=herd, m_axis=m_axis, tile_m=tm, tile_n=tn, tile_k=tile_k,
                                  tile_k_l2=tk2)
                    try:
                        text = gemm_q4nx.build(Launch("gemm", "gemm_q4nx", ("a", "w"), ("c",),
                                                      tuple(sorted(params.items()))), slots)
                    except KernelShapeError:
                        continue
                    parts = launch_components(count_module(text)[0].work, cal)
                    bound = max(parts, key=parts.get)
                    out.append(GemmCandidate(m_axis, herd, tm, tn, tk2, parts[bound], bound))
    return sorted(out, key=lambda c: c.seconds)


__all__ = ["MARGIN", "MARGIN_S", "GemmCandidate", "GemvCandidate", "best_gemv", "gemm_q4nx_candidates",
           "gemv_candidate", "gemv_candidates", "gemv_margin", "gemv_work"]
