"""The native GEMV and GEMM on tiled weights against a float64 reference, and the tiled layout itself.

Shapes cover the code paths the kernels split on: the GEMV's four-pair main loop and its single
pairs after it; the GEMM's 8-row tile and every row count left over after it (1-7), a last
16-column block that has no partner, and K from one pair up to the down projection's 8192.
"""
from __future__ import annotations

import pytest
import torch

from kernel_builder import native_cpu, sim_ops
from kernel_builder.weight_tiles import LANES, TiledWeight, from_tiles, to_tiles

pytestmark = pytest.mark.skipif(native_cpu._library() is None,
                                reason="no C++ compiler or no AVX512-BF16 on this CPU: the simulator uses torch")


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _tiled(w: torch.Tensor) -> torch.Tensor:
    t = torch.empty_like(w)
    assert native_cpu.tile_weight(w, t)
    return t


def _close_to_reference(exact: torch.Tensor, magnitude: torch.Tensor, y: torch.Tensor) -> None:
    # f32 accumulation in another order than float64's: allow a couple of f32 roundings per
    # element relative to the magnitudes summed, plus the final bf16 rounding.
    assert not torch.isnan(y).any()
    assert ((y.double() - exact).abs() <= magnitude * 2 ** -20 + exact.abs() * 2 ** -8).all()


@pytest.mark.parametrize("n,k", [(16, 2), (32, 64), (48, 578)])
def test_native_tiling_is_the_layout_definition(n, k):
    assert native_cpu.tile_rows() == LANES                # the kernels read the layout defined here
    w = _rand(n, k, seed=n + k)
    t = _tiled(w)
    assert torch.equal(t.view(-1), to_tiles(w).view(-1))
    in_place = w.clone()
    assert native_cpu.tile_weight(in_place, in_place) and torch.equal(in_place, t)
    assert torch.equal(from_tiles(t, n, k), w)
    # element (r, c) at block r // 16, pair c // 2, lane r % 16, half c % 2
    r, c = n - 1, k - 1
    assert t.view(n // LANES, k // 2, LANES, 2)[r // LANES, c // 2, r % LANES, c % 2] == w[r, c]


@pytest.mark.parametrize("n,k", [(16, 8), (32, 6), (48, 10), (64, 576), (16, 8192), (32, 8194)])
def test_tiled_gemv_matches_float64(n, k):
    w, x = _rand(n, k, seed=n * 7 + k), _rand(k, seed=k)
    y, t = torch.full((n,), float("nan"), dtype=torch.bfloat16), _tiled(w)
    native_cpu.gemv_batch_call([(t, x, y)])()      # a bound call holds pointers: keep t alive
    _close_to_reference(w.double() @ x.double(), w.double().abs() @ x.double().abs(), y)


def test_a_batch_of_unlike_gemvs_fills_every_output_row():
    shapes = [(608, 64), (16, 8192), (128, 102), (512, 2048)]
    jobs = [(_rand(n, k, seed=i), _rand(k, seed=-i), torch.full((n,), float("nan"), dtype=torch.bfloat16))
            for i, (n, k) in enumerate(shapes)]
    tiles = [_tiled(w) for w, _, _ in jobs]
    native_cpu.gemv_batch_call([(t, x, y) for t, (_, x, y) in zip(tiles, jobs)])()
    for w, x, y in jobs:
        _close_to_reference(w.double() @ x.double(), w.double().abs() @ x.double().abs(), y)


_GEMMS = [(m, n, k) for m in (1, 7, 8, 9, 15, 33) for n, k in [(16, 2), (48, 64), (80, 576)]]
_GEMMS += [(128, 512, 2048), (9, 32, 8192), (13, 48, 8192)]


@pytest.mark.parametrize("m,n,k", _GEMMS)
def test_tiled_gemm_matches_float64(m, n, k):
    a, w = _rand(m, k, seed=m), _rand(n, k, seed=n * 31 + k)
    c, t = torch.full((m, n), float("nan"), dtype=torch.bfloat16), _tiled(w)
    native_cpu.gemm_call(a, t, c)()
    _close_to_reference(a.double() @ w.double().t(), a.double().abs() @ w.double().abs().t(), c)


def test_shapes_outside_the_tiling_are_left_to_torch():
    a, w, c = _rand(4, 64, seed=1), _rand(24, 64, seed=2), torch.empty(4, 24, dtype=torch.bfloat16)
    assert native_cpu.gemm_call(a, w, c) is None                     # 24 rows: not whole blocks
    assert not native_cpu.tile_weight(w, torch.empty_like(w))
    assert native_cpu.gemm_call(a.t().contiguous().t(), _rand(16, 64, seed=3), c[:, :16].contiguous()) is None
    x = _rand(63, seed=4)
    assert native_cpu.gemv_batch_call([(_rand(16, 63, seed=5), x, torch.empty(16, dtype=torch.bfloat16))]) is None


class _Launch:
    params = ()


@pytest.mark.parametrize("op", ["gemm", "gemv"])
def test_ops_on_tiled_and_row_major_weights_agree(op):
    """What the simulated device computes does not depend on how it holds a weight: the native
    kernel on tiles against torch on the row-major matrix (f32 accumulation in both)."""
    n, k = 64, 576
    w = _rand(n, k, seed=9)
    a = _rand(5, k, seed=10) if op == "gemm" else _rand(k, seed=10)
    shape = (5, n) if op == "gemm" else (n,)
    tiled, dense = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)
    sim_ops.OPS[op](_Launch(), a, TiledWeight(_tiled(w), n, k), tiled)
    sim_ops.OPS[op](_Launch(), a, w, dense)
    assert (tiled.float() - dense.float()).abs().max() <= dense.float().abs().max() * 2 ** -7
