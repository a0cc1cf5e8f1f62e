"""The native bf16 GEMV against a float64 reference, over the row lengths its code paths split on.

Row lengths cover the 64-element main loop, a lone 32-element step, a masked tail, and rows long
enough to take the x-prefetching path (above 4096). A batch mixes them, as a decode group does.
"""
from __future__ import annotations

import pytest
import torch

from kernel_builder import native_cpu

pytestmark = pytest.mark.skipif(native_cpu._library() is None,
                                reason="no C++ compiler or no AVX512-BF16 on this CPU: the simulator uses torch")


def _case(m: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g).to(torch.bfloat16)
    x = torch.randn(k, generator=g).to(torch.bfloat16)
    return w, x, torch.full((m,), float("nan"), dtype=torch.bfloat16)


def _close_to_reference(w, x, y):
    exact = (w.double() @ x.double())
    # f32 accumulation in another order than float64's: allow a couple of f32 roundings per
    # element relative to the magnitudes summed, plus the final bf16 rounding.
    bound = (w.double().abs() @ x.double().abs()) * 2 ** -20 + exact.abs() * 2 ** -8
    assert not torch.isnan(y).any()
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("m,k", [(1, 64), (7, 96), (5, 100), (33, 576), (3, 4097), (9, 8192), (2, 8256)])
def test_single_gemv_matches_float64(m, k):
    w, x, y = _case(m, k, seed=m * 10007 + k)
    assert native_cpu.gemv(w, x, y)
    _close_to_reference(w, x, y)


def test_a_batch_of_unlike_gemvs_fills_every_output_row():
    jobs = [_case(m, k, seed=i) for i, (m, k) in enumerate([(600, 64), (1, 8192), (130, 100), (513, 2048)])]
    assert native_cpu.gemv_batch(jobs)
    for w, x, y in jobs:
        _close_to_reference(w, x, y)


def test_non_contiguous_operands_are_left_to_torch():
    w, x, y = _case(8, 64, seed=1)
    assert not native_cpu.gemv(w.t().contiguous().t(), x, y)
    assert torch.isnan(y).all()
