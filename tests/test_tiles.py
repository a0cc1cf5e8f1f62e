"""The AMX tile GEMM: its blocking, padding and layouts checked through the emulated tile
instructions on any AVX2 CPU, against an independent model of TDPBF16PS as the Intel SDM specifies
it; and, where the CPU has AMX, the real instructions against that emulation.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_kernels import native_cpu
from verify import reference as ref
from seeded import rand_bf16

EMULATED = "amx-emulated"
HAVE_EMULATION = native_cpu.runnable(EMULATED)
pytestmark = pytest.mark.skipif(not HAVE_EMULATION, reason="no AVX2 CPU or no C++ compiler")
NEEDS_AMX = pytest.mark.skipif("amx" not in native_cpu.supported_isas(),
                               reason="this CPU has no AMX-BF16 (or Linux does not grant it)")


def _sdm_gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """C = A · Wᵀ as a chain of TDPBF16PS over 16 K-pairs each: per step an even and an odd f32
    sum, each product added with one rounding, then C += even + odd; C rounded to bf16 at the end.
    (No subnormal arises from the operands used here, so DAZ/FTZ play no part.) A bf16 product is
    exact in f32, so f32 `+` after it rounds as the instruction's FMA does."""
    a32, w32 = a.float().numpy(), w.float().numpy()
    m, k = a32.shape
    c = np.zeros((m, w32.shape[0]), np.float32)
    for step in range(0, k, 32):
        even = np.zeros_like(c)
        odd = np.zeros_like(c)
        for kk in range(step, step + 32, 2):
            even = even + np.outer(a32[:, kk], w32[:, kk])
            odd = odd + np.outer(a32[:, kk + 1], w32[:, kk + 1])
        c = c + (even + odd)
    return torch.from_numpy(c).to(torch.bfloat16)


def _wide(*shape, seed: int) -> torch.Tensor:
    """Values over 2^-20..2^20, so that nearly every add of the tile step rounds."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2.0 ** torch.randint(-20, 21, shape, generator=g)).to(torch.bfloat16)


def _sdm_step(a: torch.Tensor, b: torch.Tensor, c: np.ndarray) -> np.ndarray:
    """One TDPBF16PS as the SDM's pseudo-code writes it: a [16, 32] bf16, b [16 K-pairs, 32]
    (pairs interleaved), c [16, 16] f32."""
    a32, b32 = a.float().numpy(), b.float().numpy()
    even = np.zeros((16, 16), np.float32)
    odd = np.zeros_like(even)
    for p in range(16):
        even = even + np.outer(a32[:, 2 * p], b32[p, 0::2])
        odd = odd + np.outer(a32[:, 2 * p + 1], b32[p, 1::2])
    return c + (even + odd)


def _tile_step(isa: str, a: torch.Tensor, b: torch.Tensor, c: np.ndarray) -> np.ndarray:
    out = torch.from_numpy(c.copy())
    with native_cpu.use_isa(isa):
        assert native_cpu.tile_dot(a, b, out)
    return out.numpy()


def test_the_emulated_tile_step_is_the_sdms_to_the_bit():
    a, b = _wide(16, 32, seed=1), _wide(16, 32, seed=2)
    c = _wide(16, 16, seed=3).float().numpy()
    assert np.array_equal(_tile_step(EMULATED, a, b, c).view(np.int32), _sdm_step(a, b, c).view(np.int32))
    for isa in native_cpu.supported_isas() + native_cpu.emulated_isas():   # declared tile classes = built ones
        with native_cpu.use_isa(isa):
            assert native_cpu.tile_dot(a, b, torch.zeros(16, 16)) == native_cpu.tiled(isa), isa


@NEEDS_AMX
def test_the_real_tile_step_is_the_sdms_to_the_bit():
    """What makes the emulated tests speak for AMX CPUs: the instruction rounds as specified."""
    a, b = _wide(16, 32, seed=4), _wide(16, 32, seed=5)
    c = _wide(16, 16, seed=6).float().numpy()
    real = _tile_step("amx", a, b, c)
    assert np.array_equal(real.view(np.int32), _sdm_step(a, b, c).view(np.int32)), \
        f"{int((real != _sdm_step(a, b, c)).sum())} of 256 sums differ from the SDM's pseudo-code"


def _gemm(isa: str, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with native_cpu.use_isa(isa):
        packed = native_cpu.pack_weight(w, lambda n: torch.zeros(n, dtype=torch.uint8))
        out = torch.full((a.shape[0], w.shape[0]), float("nan"), dtype=torch.bfloat16)
        native_cpu.gemm_call(a, packed, out)()
    return out


# Rows: less than a tile, one tile, a slab and a padded tail, several slabs. Columns: an odd
# number of blocks (a lone last B tile) and several panels (K = 4096 fits 2 blocks a panel).
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (13, 80, 512), (32, 96, 512), (45, 80, 256), (77, 112, 4096)])
def test_emulated_tiles_compute_what_the_sdm_specifies(m, n, k):
    a, w = rand_bf16(m, k, seed=m), rand_bf16(n, k, seed=n, scale=0.05)
    w.view(-1)[::97] = 1e-30                       # units the packing keeps whole
    got = _gemm(EMULATED, a, w)
    assert torch.equal(got.view(torch.int16), _sdm_gemm(a, w).view(torch.int16))


def test_the_tiles_order_differs_from_the_vector_gemms_and_agrees_within_rounding():
    """Same products, another summation order (even and odd sums per 16 pairs, where vdpbf16ps
    chains odd then even): both within the reference's bound for reordered sums, not always the
    same bits."""
    a, w = rand_bf16(64, 2048, seed=1), rand_bf16(64, 2048, seed=2, scale=0.05)
    tiles, vector = _gemm(EMULATED, a, w), _gemm("avx2", a, w)
    for got in (tiles, vector):
        ref.assert_within_ulps(got, ref.lin(a, w), 1, ref.REORDERED, floor=ref.sum_floor(a, w))
    assert not torch.equal(tiles, vector)


def test_k_that_is_not_whole_tile_steps_runs_the_vector_gemm():
    a, w = rand_bf16(40, 584, seed=3), rand_bf16(32, 584, seed=4, scale=0.05)
    assert torch.equal(_gemm(EMULATED, a, w).view(torch.int16), _gemm("avx2", a, w).view(torch.int16))


def test_subnormal_activations_read_as_zero_as_the_instruction_specifies():
    """DAZ: a subnormal bf16 contributes nothing on tiles; the AVX2 FMAs keep it."""
    a = torch.zeros(16, 32, dtype=torch.bfloat16)
    a.view(torch.int16)[0, 0] = 0x0040                  # a bf16 subnormal
    w = torch.ones(16, 32, dtype=torch.bfloat16)
    assert _gemm(EMULATED, a, w)[0].view(torch.int16).abs().sum() == 0
    assert _gemm("avx2", a, w)[0, 0].view(torch.int16) == 0x0040


@NEEDS_AMX
@pytest.mark.parametrize("m,n,k", [(13, 80, 512), (77, 112, 4096)])
def test_real_tiles_agree_with_the_emulation(m, n, k):
    """The hardware against the SDM's pseudo-code: within one bf16 step (the SDM does not promise
    that real cores round each step as written; a difference here is worth a report)."""
    a, w = rand_bf16(m, k, seed=m), rand_bf16(n, k, seed=n, scale=0.05)
    ref.assert_within_ulps(_gemm("amx", a, w), _gemm(EMULATED, a, w), 1)
