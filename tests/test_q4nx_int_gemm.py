"""Prefill's integer Q4NX GEMM (`gemm_q4nx_int_cpu` in native/q4nx_gemm_cpu.cc): every output row is
decode's GEMV for that activation row, bit for bit (the same fixed-point activations, exact
integer group sums and f32 combination order), so it meets `q4nx.gemv_reference` within that
contract's f32 bound; and the classes that prefill on it (`native_cpu.integer_q4nx_gemm`: AVX2)
take it through the same call the simulated device makes, the others keep the dequantizing GEMM.

The kernel exists in every class (register-blocked only in the AVX2 build, the GEMV's row-block
per row elsewhere), so the bit-equality tests run on every class this CPU has."""
from __future__ import annotations

import pytest
import torch

from cpu_kernels import native_cpu
from cpu_kernels.weight_tiles import DeviceQ4nx, Q4nxPacking
from kernel_builder.groups import build_group
from llama_base import q4nx
from llama_runtime.checkpoints import quantize

pytestmark = pytest.mark.skipif(not native_cpu.supported_isas(), reason="no native library")

# (M, N, K): M odd and below the register tile's 2 rows, one row-block for two threads, K of
# 2 groups (no 8-group block of the vectorized conversion), 18 groups (16 + a scalar tail), and
# the model's widths.
SHAPES = [(1, 32, 64), (3, 32, 576), (37, 96, 576), (130, 64, 2048), (5, 32, 8192), (300, 32, 256)]


def _alloc(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(declared bytes, device form) of a quantized random [n, k] matrix."""
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    buf = quantize.quantize(w)
    return buf, Q4nxPacking(n, k).pack(buf, _alloc)


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows spread over 2^-30..2^30 across columns, signs mixed, with an all-zero group, a group of
    bf16 subnormals and one of values below 2^-113 (the conversion's scalar cases) where K allows."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.logspace(-30, 30, k, base=2.0)
    if k >= 4 * q4nx.GROUP:
        a[:, 0:32] = 0
        a[:, 32:64] = torch.randn(m, 32, generator=g) * 1e-39
        a[:, 64:96] = torch.randn(m, 32, generator=g) * 1e-36
    return a.to(torch.bfloat16)


def _gemv_rows(dev: torch.Tensor, a: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(a.shape[0], n, dtype=torch.bfloat16)
    for i in range(a.shape[0]):
        native_cpu.gemv_q4nx_batch_call([(dev, a[i].contiguous(), out[i])])()
    return out


def _gemm(a: torch.Tensor, dev: torch.Tensor, n: int, integer: bool | None = True) -> torch.Tensor:
    c = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16)
    native_cpu.gemm_q4nx_call(a, dev, c, integer=integer)()
    return c


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_rows_are_the_gemv_rows_bit_for_bit(native_isa, m, n, k):
    if native_isa == native_cpu.TORCH:
        pytest.skip("no native library")
    _, dev = _weights(n, k, seed=m + n + k)
    a = _activations(m, k, seed=k)
    assert torch.equal(_gemm(a, dev, n).view(torch.int16), _gemv_rows(dev, a, n).view(torch.int16))


def test_every_class_of_one_width_computes_the_same_integer_gemm():
    """Decode's contract has one answer per activation width: the AVX2 tiles, the per-row GEMV of
    the AVX-512 build and the GEMV of any class of that width agree to the bit."""
    classes = native_cpu.supported_isas() + native_cpu.emulated_isas()
    m, n, k = 37, 96, 576
    _, dev = _weights(n, k, seed=5)
    a = _activations(m, k, seed=6)
    for width in (q4nx.WIDE, q4nx.NARROW):
        outs = []
        for isa in (c for c in classes if native_cpu.q4nx_activation_bytes(c) == width):
            with native_cpu.use_isa(isa):
                outs += [_gemm(a, dev, n), _gemv_rows(dev, a, n)]
        assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:]), width


def _f32_bound(buf: torch.Tensor, a: torch.Tensor, n: int, k: int, width: int) -> torch.Tensor:
    """How far two f32 evaluations of decode's contract may be apart, per output: both add the
    same 2G terms (G groups of (scale u) S + min sum(x), S exact) in different orders, each within
    2G rounding steps of 2^-24 of the terms' magnitudes."""
    q, sc, mn = q4nx.unpack(buf, n, k)
    g = k // q4nx.GROUP
    bound = torch.empty(a.shape[0], n, dtype=torch.float64)
    for i in range(a.shape[0]):
        X, u = q4nx.fixed_point(a[i], width)
        s = torch.einsum("ngc,gc->ng", q.double().view(n, g, q4nx.GROUP), X.double().view(g, q4nx.GROUP))
        xs = a[i].double().view(g, q4nx.GROUP).sum(1)
        terms = (s * sc.double() * u.double()).abs() + (mn.double() * xs).abs()
        bound[i] = 2 * (2 * g) * 2.0 ** -24 * terms.sum(1)
    return bound


@pytest.mark.parametrize("m,n,k", [(37, 96, 576), (3, 64, 2048)])
def test_the_gemm_meets_the_gemv_reference(native_isa, m, n, k):
    """Against `q4nx.gemv_reference` (f32, torch's order) rounded to bf16: within both bf16
    roundings (each within 2^-8 of its value, bf16's unit roundoff) and the two f32 orders' bound."""
    if native_isa == native_cpu.TORCH:
        pytest.skip("no native library")
    buf, dev = _weights(n, k, seed=k)
    a = _activations(m, k, seed=m)
    width = native_cpu.q4nx_activation_bytes(native_isa)
    got = _gemm(a, dev, n).double()
    ref = torch.stack([q4nx.gemv_reference(buf, a[i], n, k, width) for i in range(m)]).double()
    ref_bf16 = ref.to(torch.bfloat16).double()
    bound = 2.0 ** -8 * (got.abs() + ref.abs()) + _f32_bound(buf, a, n, k, width)
    assert ((got - ref_bf16).abs() <= bound).all()


def test_16_bit_group_sums_at_their_bound(native_isa):
    """Every value 15 and every activation byte at -128 or -127: each 16-bit lane of a group
    reaches the most the AVX2 kernels add before widening (8 x 2 x 15 x (-128) = -30720 wide,
    8 x 2 x 15 x (-127) = -30480 narrow); nothing saturates, so the rows are still the GEMV's
    and equal to the exact integer sums.

    Wide: Xl = -128 (X = 128 times an odd number), Xh up to 63. Narrow: every X = -127 (a group
    of equal magnitudes), or the group's largest at 127 and the rest odd multiples."""
    if native_isa == native_cpu.TORCH:
        pytest.skip("no native library")
    width = native_cpu.q4nx_activation_bytes(native_isa)
    n, k, m = 64, 256, 5
    q = torch.full((n, k), 15, dtype=torch.uint8)
    ones = torch.ones(n, k // q4nx.GROUP, dtype=torch.bfloat16)
    buf = q4nx.pack(q, ones, torch.zeros_like(ones))
    dev = Q4nxPacking(n, k).pack(buf, _alloc)
    g = torch.Generator().manual_seed(0)
    if width == q4nx.WIDE:
        odd = torch.randint(-63, 64, (m, k), generator=g) * 2 + 1           # |X| = 128 |odd| <= 16256
        odd[:, ::q4nx.GROUP] = 127                                          # each group's largest: X = 16256, u = 2^-10
        odd[0] = -1                                                          # a row of X = -128: l = -128, h = 0
        odd[0, ::q4nx.GROUP] = -127
        a = (odd * 128 * 2.0 ** -10).to(torch.bfloat16)
        X, u = q4nx.fixed_point(a[1], width)
        assert (u == 2.0 ** -10).all() and ((X.long() & 255) == 128).all()
    else:
        a = (torch.randint(-63, 64, (m, k), generator=g) * 2 + 1).float()   # exact in bf16; X = x where top = 127
        a[:, ::q4nx.GROUP] = 127
        a[0] = -1.0                                                           # a row of X = -127
        a = a.to(torch.bfloat16)
        X, u = q4nx.fixed_point(a[0], width)
        assert (X == -127).all()
    got = _gemm(a, dev, n)
    assert torch.equal(got.view(torch.int16), _gemv_rows(dev, a, n).view(torch.int16))
    exact = (a.double() @ torch.full((k, n), 15.0, dtype=torch.float64))
    assert torch.equal(got, exact.to(torch.bfloat16))


def test_avx2_prefills_on_the_integer_gemm_and_the_others_dequantize():
    assert native_cpu.integer_q4nx_gemm("avx2")
    assert not any(native_cpu.integer_q4nx_gemm(c) for c in ("avx512bf16", "amx", "amx-emulated"))
    n, k, m = 64, 576, 9
    _, dev = _weights(n, k, seed=1)
    a = _activations(m, k, seed=2)
    for isa in native_cpu.supported_isas() + native_cpu.emulated_isas():
        with native_cpu.use_isa(isa):
            default, integer, dequant = _gemm(a, dev, n, None), _gemm(a, dev, n, True), _gemm(a, dev, n, False)
        assert not torch.equal(integer, dequant)          # the two contracts differ on these rows
        assert torch.equal(default, integer if native_cpu.integer_q4nx_gemm(isa) else dequant), isa


def test_the_simulated_prefill_launch_takes_the_class_s_gemm(tiny_config):
    """The device's gemm_q4nx launch binds through `native_cpu.gemm_q4nx_call`: on AVX2 it gives
    the GEMV's rows."""
    from npu_runtime.sim import ops

    if "avx2" not in native_cpu.supported_isas():
        pytest.skip("no avx2 class on this CPU")
    launch = next(l for l in build_group("o_ffn", tiny_config, 32, quant=q4nx.NAME).launches if l.name == "up_proj")
    n, k = launch.p("N"), launch.p("K")
    buf, dev = _weights(n, k, seed=3)
    a, c = _activations(32, k, seed=4), torch.empty(32, n, dtype=torch.bfloat16)
    with native_cpu.use_isa("avx2"):
        ops.bind(launch, {"normed": a, "w_up": DeviceQ4nx(dev, n, k), "up": c})()
        assert torch.equal(c, _gemv_rows(dev, a, n))
