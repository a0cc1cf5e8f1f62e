"""Ranking GEMV tilings by the cost model, legal or not, with the rules each one breaks.

A candidate is a herd width (cores in one array row), rows per L1 slab (`tile_m`) and whether
the slab is double-buffered. Its work is what `kernel_builder.mlir.gemv` emits for it (x once
per core, one DMA per slab, one output DMA per slab), counted in closed form so candidates the
builder refuses can be costed too; `tests/test_cost_model.py` holds the closed form to the
walker's count of the built module wherever the builder accepts the candidate. Without double
buffering a core waits for each slab, so its DMA and compute times add instead of overlapping.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernel_builder.backend_presets import ARRAY_COLS, BF16, L1_BUDGET
from npu_runtime.cost.counts import Work
from npu_runtime.cost.hardware import FITTED, WORD_BYTES, Calibration
from npu_runtime.cost.model import launch_components


@dataclass(frozen=True)
class GemvCandidate:
    cores: int
    tile_m: int
    double_buffered: bool
    seconds: float
    l1_bytes: int
    broken: tuple[str, ...]     # the NPU rules it breaks; empty if the NPU would accept it

    @property
    def legal(self) -> bool:
        return not self.broken


def gemv_work(m: int, k: int, cores: int, tile_m: int) -> Work:
    slabs = m // tile_m
    per_core_slabs = slabs // cores
    return Work(l3_read=(m * k + cores * k) * BF16, l3_write=m * BF16, l3_dmas=cores + 2 * slabs,
                macs=m * k, core_macs=per_core_slabs * tile_m * k,
                core_dma_bytes=(k + per_core_slabs * tile_m * (k + 1)) * BF16, cores=cores, columns=cores)


def gemv_candidates(m: int, k: int, cal: Calibration = FITTED) -> list[GemvCandidate]:
    """Every (cores, tile_m, buffering) that splits `m` evenly, fastest first."""
    out = []
    for cores in (c for c in range(ARRAY_COLS, 0, -1) if m % c == 0):
        per_core = m // cores
        for tm in (t for t in range(1, per_core + 1) if per_core % t == 0):
            for double in (True, False):
                l1 = (k + (2 if double else 1) * tm * k + tm) * BF16
                broken = []
                if l1 > L1_BUDGET:
                    broken.append(f"L1 {l1} B > {L1_BUDGET} B")
                if (tm * BF16) % WORD_BYTES:
                    broken.append(f"{tm * BF16}-byte output DMA (not whole 32-bit words)")
                work = gemv_work(m, k, cores, tm)
                parts = launch_components(work, cal)
                compute = parts.pop("compute")
                t = max(compute, *parts.values()) if double else compute + max(parts.values())
                out.append(GemvCandidate(cores, tm, double, t, l1, tuple(broken)))
    return sorted(out, key=lambda c: (c.seconds, not c.legal))


def best_gemv(m: int, k: int, cal: Calibration = FITTED) -> GemvCandidate | None:
    """The fastest candidate the NPU would accept, or None when none is."""
    return next((c for c in gemv_candidates(m, k, cal) if c.legal), None)


__all__ = ["GemvCandidate", "best_gemv", "gemv_candidates", "gemv_work"]
