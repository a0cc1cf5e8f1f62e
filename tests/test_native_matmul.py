"""The native GEMV and GEMM on packed weights against `reference.lin`, and the packed layout itself.

Shapes cover the code paths the kernels split on: the GEMM's 8-row tile that unpacks a panel
and the row counts after it (1-7 left over), a last 16-column block that has no partner, units
kept whole because they hold an exponent outside the matrix's 8 pairs, and K from one unit up to the down
projection's 8192. The kernels sum in f32 in their own order: `reference.REORDERED`, each output
measured at least at `CANCELLED` of its terms' size (`sum_floor`).
"""
from __future__ import annotations

from functools import partial

import pytest
import torch

from cpu_kernels import native_cpu
from cpu_kernels.weight_tiles import HEADER, LANES, UNIT_BYTES, PackedWeight, from_packed, to_tiles
from verify import reference as ref
from npu_runtime.sim import ops as sim_ops
from seeded import rand_bf16

pytestmark = [pytest.mark.skipif(native_cpu._library() is None,
                                 reason="no C++ compiler or no AVX2/AVX512-BF16 on this CPU: the simulator uses torch"),
              pytest.mark.usefixtures("native_isa")]   # every ISA class this CPU runs


_rand = partial(rand_bf16, scale=0.02)


def _packed(w: torch.Tensor) -> torch.Tensor:
    out = native_cpu.pack_weight(w, lambda nbytes: torch.full((nbytes,), 0xAB, dtype=torch.uint8))
    assert out is not None
    return out


def _with_outliers(w: torch.Tensor) -> torch.Tensor:
    """Values whose exponents the rest do not use: zeros, a subnormal, huge, inf, NaN."""
    w = w.clone()
    specials = [0.0, -0.0, 1e-40, -3e38, float("inf"), float("-inf"), float("nan"), 1e-30, 7.0]
    for i, v in enumerate(specials):
        w.view(-1)[(i * 7919) % w.numel()] = v
    return w


def _matches_lin(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x Wᵀ as `reference.lin` computes it, to the reordered sums' bound; a 1 % scale fails it."""
    want, floor = ref.lin(x, w), ref.sum_floor(x, w)
    ref.assert_within_ulps(y, want, 1, ref.REORDERED, floor=floor)
    with pytest.raises(AssertionError):
        ref.assert_within_ulps((y.float() * 1.01).bfloat16(), want, 1, ref.REORDERED, floor=floor)


@pytest.mark.parametrize("n,k", [(32, 64), (64, 128), (48, 580), (16, 8192)])
def test_packing_is_lossless_and_laid_out_as_documented(n, k):
    assert native_cpu.tile_rows() == LANES and native_cpu.packed_header() == HEADER   # the kernels read this layout
    w = _with_outliers(_rand(n, k, seed=n + k))
    p = _packed(w)
    assert torch.equal(from_packed(p, n, k).view(torch.int16), w.view(torch.int16))     # every bit, NaN included
    escapes, hn, hk = p[8:32].view(torch.int64).tolist()
    assert (hn, hk) == (n, k) and 0 < escapes < n * k // 64    # some units kept whole, not all
    pairs = p[:8].tolist()
    assert len(set(pairs)) == 8 and max(pairs) < 128
    # a unit without outliers: value e of tile vector A has its nibble (sign, index of its
    # exponent pair) in the low half of byte q(e) and its low byte at 32 + q(e), where q swaps
    # bits 3 and 4 of e; value (r, c) is element r % 16 * 2 + c % 2 of K-pair c // 2
    tiles = to_tiles(w).view(n // LANES, k // 4, 2, 32).view(torch.int16).int() & 0xFFFF
    clean = torch.isin(tiles >> 8 & 0x7F, torch.tensor(pairs)).all(-1).all(-1)
    blk, u = map(int, clean.nonzero()[-1])
    unit = p[HEADER + (blk * (k // 4) + u) * UNIT_BYTES:][:UNIT_BYTES].int()
    for e, q in ((0, 0), (9, 17), (18, 10), (31, 31)):
        v = int(tiles[blk, u, 0, e])
        assert int(unit[q]) & 15 == (v >> 15) << 3 | pairs.index(v >> 8 & 0x7F)
        assert int(unit[32 + q]) == v & 0xFF


def test_packing_reads_three_quarters_of_the_bytes():
    w = _rand(512, 2048, seed=5)
    assert _packed(w).numel() < 0.78 * w.numel() * w.element_size()


@pytest.mark.parametrize("n,k", [(16, 4), (32, 8), (48, 12), (64, 576), (16, 8192), (32, 8196)])
def test_packed_gemv_matches_the_reference(n, k):
    w, x = _rand(n, k, seed=n * 7 + k), _rand(k, seed=k)
    w.view(-1)[:: 97] = 1e-30              # units kept whole, spread over blocks
    y, p = torch.full((n,), float("nan"), dtype=torch.bfloat16), _packed(w)
    native_cpu.gemv_batch_call([(p, x, y)])()      # a bound call holds pointers: keep p alive
    _matches_lin(y, x, w)


def test_a_batch_of_unlike_gemvs_fills_every_output_row():
    shapes = [(608, 64), (16, 8192), (128, 100), (512, 2048)]
    jobs = [(_rand(n, k, seed=i), _rand(k, seed=-i), torch.full((n,), float("nan"), dtype=torch.bfloat16))
            for i, (n, k) in enumerate(shapes)]
    packed = [_packed(w) for w, _, _ in jobs]
    native_cpu.gemv_batch_call([(p, x, y) for p, (_, x, y) in zip(packed, jobs)])()
    for w, x, y in jobs:
        _matches_lin(y, x, w)


_GEMMS = [(m, n, k) for m in (1, 7, 8, 9, 15, 33) for n, k in [(16, 4), (48, 64), (80, 576)]]
_GEMMS += [(128, 512, 2048), (9, 32, 8192), (13, 48, 8192)]


@pytest.mark.parametrize("m,n,k", _GEMMS)
def test_packed_gemm_matches_the_reference(m, n, k):
    a, w = _rand(m, k, seed=m), _rand(n, k, seed=n * 31 + k)
    w.view(-1)[:: 89] = 1e-30
    c, p = torch.full((m, n), float("nan"), dtype=torch.bfloat16), _packed(w)
    native_cpu.gemm_call(a, p, c)()
    _matches_lin(c, a, w)


def test_shapes_outside_the_packing_are_left_to_torch():
    a, w, c = _rand(4, 64, seed=1), _rand(24, 64, seed=2), torch.empty(4, 24, dtype=torch.bfloat16)
    assert native_cpu.pack_weight(w, torch.empty) is None                  # 24 rows: not whole blocks
    assert native_cpu.pack_weight(_rand(16, 66, seed=3), torch.empty) is None   # K: not whole units
    p = _packed(_rand(16, 64, seed=3))
    assert native_cpu.gemm_call(a.t().contiguous().t(), p, c[:, :16].contiguous()) is None   # A not row-major
    assert native_cpu.gemm_call(a, _rand(16, 64, seed=3), c[:, :16].contiguous()) is None    # W not packed
    x = _rand(32, seed=4)
    assert native_cpu.gemv_batch_call([(p, x, torch.empty(16, dtype=torch.bfloat16))]) is None   # [16, 64] is not [16, 32]


class _Launch:
    params = ()


@pytest.mark.parametrize("op", ["gemm", "gemv"])
def test_ops_on_packed_and_row_major_weights_match_the_reference(op):
    """What the simulated device computes does not depend on how it holds a weight: its launch op
    on packed tiles (native) and on the row-major matrix (torch) each give `reference.lin`."""
    n, k = 64, 576
    w = _rand(n, k, seed=9)
    a = _rand(5, k, seed=10) if op == "gemm" else _rand(k, seed=10)
    shape = (5, n) if op == "gemm" else (n,)
    for weight in (PackedWeight(_packed(w), n, k), w):
        out = torch.empty(shape, dtype=torch.bfloat16)
        sim_ops.OPS[op](_Launch(), a, weight, out)
        _matches_lin(out, a, w)
