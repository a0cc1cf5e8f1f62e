"""Q4NX, the 4-bit weight format: its layout and codec, the quantizers (from bf16 and from GGUF
Q4_1), the simulated device's form of it, and the native kernels on every CPU class against
`reference` (decode: `gemv_q4nx`, on `q4nx.gemv_reference`; prefill: `lin_q4nx`, on
`q4nx.dequantize`)."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from cpu_kernels import native_cpu
from cpu_kernels.weight_tiles import Q4nxPacking
from kernel_builder.groups import all_groups, build_group, lm_head_gemv
from llama_base.group_contract import Role
from llama_base.weight_formats import QUANTS
from llama_base import q4nx
from llama_runtime.checkpoints import quantize
from verify import reference as ref
from llama_runtime.engine.weight_slots import static_tensors
from llama_runtime.cli.profile_report import q4nx_line
from llama_runtime.checkpoints.weights import synthetic_weights
from seeded import rand_bf16

SHAPES = [(32, 256), (64, 576), (96, 64), (32, 1536)]   # 576 = 2 x 256 + a 64-wide last block


_rand = partial(rand_bf16, scale=0.02)


def _alloc(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_the_layout_is_five_bits_a_weight_and_refuses_shapes_it_cannot_hold():
    assert q4nx.nbytes(32, 256) == 5120                   # one whole block, as the papers size it
    assert q4nx.nbytes(2048, 8192) * 8 == 2048 * 8192 * 5
    layout = q4nx.Layout(64, 576)
    assert layout.col_blocks() == [(0, 256), (256, 256), (512, 64)]
    assert layout.block_offset(1, 512) == layout.row_block_bytes + 512 * q4nx.BYTES_PER_COL
    for (n, k), says in [((48, 256), "48 rows"), ((32, 48), "48 columns"), ((0, 40), "0 rows and 40 columns")]:
        with pytest.raises(q4nx.Q4nxShapeError, match=rf"\[{n}, {k}\] has {says}$"):
            q4nx.Layout(n, k)


@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_and_unpack_round_trip_every_field(n, k):
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s, m = _rand(n, k // 32, seed=1, scale=1.0), _rand(n, k // 32, seed=2, scale=1.0)
    buf = q4nx.pack(q, s, m)
    assert buf.numel() == q4nx.nbytes(n, k)
    q2, s2, m2 = q4nx.unpack(buf, n, k)
    assert torch.equal(q2, q) and torch.equal(s2, s) and torch.equal(m2, m)


def test_the_bytes_are_where_the_declaration_says():
    """Row 17, column 300 of a [64, 576] matrix: row-block 0, column block 1 (col 44 in it),
    high nibble of byte 1 of that column; its group is the block's second."""
    n, k = 64, 576
    q = torch.zeros(n, k, dtype=torch.uint8)
    q[17, 300] = 11
    s = torch.zeros(n, k // 32, dtype=torch.bfloat16)
    s[17, 300 // 32] = 3.0
    buf = q4nx.pack(q, s, torch.zeros_like(s))
    block = q4nx.Layout(n, k).block_offset(0, 256)
    assert buf[block + 44 * 16 + 1] == 11 << 4
    scales = block + 256 * 16
    at = scales + (1 * 32 + 17) * 2
    assert buf[at:at + 2].view(torch.bfloat16).item() == 3.0
    assert int(buf.count_nonzero()) == 3                  # the value byte and the two bytes of 3.0 (0x4040)


def test_dequantize_is_q_times_scale_plus_min_rounded_once():
    q = torch.tensor([[15] * 32] * 32, dtype=torch.uint8)
    s = torch.full((32, 1), 0.1, dtype=torch.bfloat16)
    m = torch.full((32, 1), -0.7, dtype=torch.bfloat16)
    w = q4nx.dequantize(q4nx.pack(q, s, m), 32, 32)
    exact = 15 * s.float() + m.float()                    # the product is exact in f32
    assert torch.equal(w, exact.to(torch.bfloat16).expand(32, 32))


def test_the_quantizer_beats_the_range_fit_and_stays_within_a_step():
    w = _rand(256, 512, seed=5)
    buf = quantize.quantize(w)
    back = q4nx.dequantize(buf, 256, 512).float()
    _, s, _ = q4nx.unpack(buf, 256, 512)
    err = (back - w.float()).view(256, 16, 32)
    step = s.float().view(256, 16, 1)
    # The least-squares refit may clamp a group's extremes a little past half a step, never a step.
    assert bool((err.abs() < step).all())
    g = w.float().view(-1, 32)
    lo, hi = g.min(1).values, g.max(1).values
    rs, rm = ((hi - lo) / 15).bfloat16().float(), lo.bfloat16().float()
    rq = torch.round((g - rm[:, None]) / rs[:, None]).clamp(0, 15)
    range_err = ((rq * rs[:, None] + rm[:, None]).bfloat16().float() - g).pow(2).sum()
    assert err.pow(2).sum() < range_err


def test_a_constant_group_is_held_exactly():
    w = torch.full((32, 64), 0.25, dtype=torch.bfloat16)
    assert torch.equal(q4nx.dequantize(quantize.quantize(w), 32, 64), w)


def test_q4_1_blocks_keep_their_values_and_lose_only_the_scale_rounding():
    """A GGUF Q4_1 tensor made here (fp16 d and m, 16 bytes of nibbles: element j low, j + 16 high):
    the converted Q4NX keeps every 4-bit value, and its weights stay within a small fraction of a
    step of Q4_1's own."""
    n, k = 32, 64
    g = torch.Generator().manual_seed(9)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half()
    m = (-torch.rand(n, k // 32, generator=g) * 15 * d.float()).half()     # a group's min: up to 15 steps below 0
    qb = q.view(n, k // 32, 32)
    raw = torch.cat([d.view(torch.uint8).view(n, -1, 2), m.view(torch.uint8).view(n, -1, 2),
                     qb[..., :16] | (qb[..., 16:] << 4)], dim=-1).reshape(n, -1).numpy()
    q2, d2, m2 = quantize.q4_1_fields(raw, n, k)
    assert torch.equal(q2, q) and torch.equal(d2, d.float()) and torch.equal(m2, m.float())
    s, mn = quantize.q4_1_to_q4nx(q2, d2, m2)
    got = q4nx.dequantize(q4nx.pack(q2, s, mn), n, k).float().view(n, -1, 32)
    exact = qb.float() * d.float()[..., None] + m.float()[..., None]
    # Off by a small part of a step, besides the bf16 rounding every dequantized weight has.
    assert bool(((got - exact).abs() <= 0.1 * d.float()[..., None] + exact.abs() * 2 ** -8).all())
    loss = quantize.q4_1_loss(q2, d2, m2)
    assert 0 < loss["rms_change_over_step_rms"] < 0.2 and loss["max_change_in_steps"] < 0.2


def test_q4_k_super_blocks_read_as_gguf_dequantizes_them():
    """Q4_K's fields (scale d sc_j and min -dmin m_j per 32 weights, 6-bit sc and m packed in
    12 bytes, nibbles low-then-high per 64 weights) give exactly gguf-py's dequantized values,
    and their Q4NX conversion loses only the bf16 rounding of scales and mins."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    n, k = 32, 512
    rng = np.random.default_rng(4)
    b = rng.integers(0, 256, (n, k // quantize.Q4_K_WEIGHTS, quantize.Q4_K_BYTES), dtype=np.uint8)
    b[..., 0:2] = (rng.random(b.shape[:2]) * 2e-3).astype(np.float16)[..., None].view(np.uint8)
    b[..., 2:4] = (rng.random(b.shape[:2]) * 1e-2).astype(np.float16)[..., None].view(np.uint8)
    raw = b.reshape(n, -1)
    want = torch.from_numpy(np.array(dequantize(raw, T.Q4_K), dtype=np.float32))
    q, d, m = quantize.q4_k_fields(raw, n, k)
    assert int(q.max()) == 15 and int(q.min()) == 0
    assert torch.equal((q.view(n, -1, 32).float() * d[..., None] + m[..., None]).view(n, k), want)
    s, mn = quantize.q4_1_to_q4nx(q, d, m)
    got = q4nx.dequantize(q4nx.pack(q, s, mn), n, k).float()
    step, low = d.repeat_interleave(32, dim=1), m.abs().repeat_interleave(32, dim=1)
    # These random bytes put mins up to hundreds of steps from 0, so the min's own bf16 rounding
    # shows here; a quantizer's mins lie within a group's 15 steps.
    assert bool(((got - want).abs() <= 0.1 * step + (want.abs() + low) * 2 ** -8).all())


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_device_form_round_trips(n, k):
    buf = torch.randint(0, 256, (q4nx.nbytes(n, k),), generator=torch.Generator().manual_seed(k), dtype=torch.uint8)
    p = Q4nxPacking(n, k)
    dev = p.pack(buf, _alloc)
    assert dev.numel() == buf.numel() and not torch.equal(dev, buf)
    assert torch.equal(p.unpack(dev, torch.empty_like(buf)), buf)


def test_fixed_point_is_exact_near_the_group_maximum():
    x = torch.tensor([1.5, -0.75, 2.0 ** -6, 2.0 ** -9 * 1.5] + [0.0] * 28, dtype=torch.bfloat16)
    X, u = q4nx.fixed_point(x)
    assert u.tolist() == [2.0 ** (0 + 1 - q4nx.FIXED_BITS)]
    back = X[0] * u[0]
    assert back[:3].tolist() == x.float()[:3].tolist()       # within 2^6 of the largest: exact
    assert abs(back[3].item() - x[3].item()) <= u[0].item() / 2
    assert X.abs().max() < 2 ** q4nx.FIXED_BITS


def test_narrow_fixed_point_maps_each_group_onto_signed_bytes():
    """One byte: the group's largest |x| becomes ±127 and every x is within u / 2 of X u; a group
    of zeros, or one below 2^NARROW_FLOOR_EXP, is zeros with u = 1."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4 * q4nx.GROUP, generator=g)
    x[q4nx.GROUP + 3] = -40.0                                   # group 1's largest, negative
    x[2 * q4nx.GROUP:3 * q4nx.GROUP] = 0
    x[3 * q4nx.GROUP:] = 2.0 ** (q4nx.NARROW_FLOOR_EXP - 1)
    x = x.to(torch.bfloat16)
    X, u = q4nx.fixed_point(x, q4nx.NARROW)
    assert X.abs().max() <= q4nx.NARROW_LEVELS and X[1, 3] == -q4nx.NARROW_LEVELS
    assert X[0].abs().max() == q4nx.NARROW_LEVELS
    assert ((X[:2] * u[:2, None] - x.float().view(-1, q4nx.GROUP)[:2]).abs() <= u[:2, None] / 2).all()
    assert not X[2:].any() and u[2:].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):
        q4nx.fixed_point(x, 3)


@pytest.mark.parametrize("width", [q4nx.WIDE, q4nx.NARROW])
def test_the_gemv_reference_is_the_product_of_the_dequantized_weights(width):
    """Either width stays near the exact product: wide within bf16's own step, narrow within
    its byte's 1/254 of each group's largest |x| (summed over the groups)."""
    n, k = 64, 576
    buf = quantize.quantize(_rand(n, k, seed=3))
    x = _rand(k, seed=4, scale=1.0)
    w = q4nx.dequantize(buf, n, k).float()
    ref = w @ x.float()
    got = q4nx.gemv_reference(buf, x, n, k, width)
    if width == q4nx.WIDE:
        assert torch.allclose(got, ref, rtol=0, atol=float(ref.abs().max()) * 2 ** -7)
    else:
        _, u = q4nx.fixed_point(x, width)
        bound = (w.abs().view(n, -1, q4nx.GROUP).sum(2) * u / 2).sum(1) * (1 + 2 ** -10)
        assert ((got - ref).abs() <= bound).all()


def test_the_narrow_min_sees_the_bytes_error():
    """Narrow decode multiplies each min by u * sum(X), not by the exact sum of x: a Q4NX weight
    is a large positive q * scale that its min cancels, and only if both see the same rounded
    activations does their error cancel too. Against the exact product, over 8 activation rows,
    the group_sums form is the closer by a clear factor (about 1.4-2.5 on random weights; the
    exact-sum form, which the wide contract keeps, would be 1)."""
    n, k = 256, 2048
    buf = quantize.quantize(_rand(n, k, seed=50))
    q, sc, mn = q4nx.unpack(buf, n, k)
    w = q.double() * sc.double().repeat_interleave(q4nx.GROUP, 1) + mn.double().repeat_interleave(q4nx.GROUP, 1)
    ours = exact_sum = 0.0
    for seed in range(8):
        x = _rand(k, seed=100 + seed, scale=1.0)
        exact = w @ x.double()
        X, u = q4nx.fixed_point(x, q4nx.NARROW)
        sums = torch.einsum("ngc,gc->ng", q.double().view(n, -1, q4nx.GROUP), X.double())
        other = (sums * sc.double() * u.double() + mn.double() * x.double().view(-1, q4nx.GROUP).sum(1)).sum(1)
        ours += float((q4nx.gemv_reference(buf, x, n, k, q4nx.NARROW).double() - exact).pow(2).sum())
        exact_sum += float((other - exact).pow(2).sum())
    assert (exact_sum / ours) ** 0.5 > 1.25


def _matches_decode(y, x, buf, n, k, cls=native_cpu.TORCH):
    """`reference.gemv_q4nx` at class `cls`'s activation width: the same exact integer sums, the
    groups combined in another order (`REORDERED`, each output at least at `CANCELLED` of its
    terms). The prefill form (each weight rounded to bf16 first) and the other width fail it:
    each contract is its own."""
    width = native_cpu.q4nx_activation_bytes(cls)
    want, floor = ref.gemv_q4nx(x, buf, width), ref.sum_floor(x, q4nx.dequantize(buf, n, k))
    ref.assert_within_ulps(y, want, 1, ref.REORDERED, floor=floor)
    for other in (ref.lin_q4nx(x, buf), ref.gemv_q4nx(x, buf, q4nx.WIDE + q4nx.NARROW - width)):
        with pytest.raises(AssertionError):
            ref.assert_within_ulps(other, want, 1, ref.REORDERED, floor=floor)


def _matches_prefill(c, a, buf, n, k):
    """`reference.lin_q4nx`: the bf16 GEMM's sums on the dequantized weights (`REORDERED`); a
    1 % scale fails it."""
    want, floor = ref.lin_q4nx(a, buf), ref.sum_floor(a, q4nx.dequantize(buf, n, k))
    ref.assert_within_ulps(c, want, 1, ref.REORDERED, floor=floor)
    with pytest.raises(AssertionError):
        ref.assert_within_ulps((c.float() * 1.01).bfloat16(), want, 1, ref.REORDERED, floor=floor)


def _matches_prefill_of(cls, c, a, buf, n, k):
    """The prefill contract of class `cls`: decode's, row by row, where it prefills on byte
    products (`native_cpu.integer_q4nx_gemm`), else `lin_q4nx`."""
    if native_cpu.integer_q4nx_gemm(cls):
        for row in range(a.shape[0]):
            _matches_decode(c[row], a[row], buf, n, k, cls)
    else:
        _matches_prefill(c, a, buf, n, k)


@pytest.mark.parametrize("n,k", SHAPES)
def test_native_q4nx_gemv_and_gemm_match_the_reference_on_every_class(native_isa, n, k):
    if native_isa == native_cpu.TORCH:
        pytest.skip("no native library")
    buf = quantize.quantize(_rand(n, k, seed=n))
    dev = Q4nxPacking(n, k).pack(buf, _alloc)
    x = (_rand(k, seed=7, scale=1.0).float() * torch.linspace(0.01, 3, k)).to(torch.bfloat16)
    y = torch.empty(n, dtype=torch.bfloat16)
    native_cpu.gemv_q4nx_batch_call([(dev, x, y)])()
    _matches_decode(y, x, buf, n, k, native_isa)
    a = _rand(37, k, seed=8, scale=1.0)
    c = torch.empty(37, n, dtype=torch.bfloat16)
    native_cpu.gemm_q4nx_call(a, dev, c)()
    _matches_prefill_of(native_isa, c, a, buf, n, k)


def test_a_profile_names_the_contract_the_class_s_kernels_compute(native_isa):
    """`make profile`'s Q4NX line, read back and held against the kernels: the width it names is
    the one the GEMV meets (and not the other), the prefill it names the one the GEMM meets."""
    if native_isa == native_cpu.TORCH:
        pytest.skip("no native library")
    line = q4nx_line(native_isa)
    width = q4nx.NARROW if "activations one byte wide" in line else q4nx.WIDE
    assert width == q4nx.NARROW or "activations two bytes wide" in line
    n, k = 64, 576
    buf = quantize.quantize(_rand(n, k, seed=21))
    dev = Q4nxPacking(n, k).pack(buf, _alloc)
    x = (_rand(k, seed=22, scale=1.0).float() * torch.linspace(0.01, 3, k)).to(torch.bfloat16)
    y = torch.empty(n, dtype=torch.bfloat16)
    native_cpu.gemv_q4nx_batch_call([(dev, x, y)])()
    want, floor = ref.gemv_q4nx(x, buf, width), ref.sum_floor(x, q4nx.dequantize(buf, n, k))
    ref.assert_within_ulps(y, want, 1, ref.REORDERED, floor=floor)
    a = _rand(9, k, seed=23, scale=1.0)
    c = torch.empty(9, n, dtype=torch.bfloat16)
    native_cpu.gemm_q4nx_call(a, dev, c)()
    if "prefill on byte products" in line:
        deq = q4nx.dequantize(buf, n, k)
        for row in range(a.shape[0]):
            ref.assert_within_ulps(c[row], ref.gemv_q4nx(a[row], buf, width), 1, ref.REORDERED,
                                   floor=ref.sum_floor(a[row], deq))
    else:
        assert "prefill on the dequantized bf16 weights" in line
        _matches_prefill(c, a, buf, n, k)


@pytest.mark.parametrize("k", [576, 2048])
def test_the_gemv_converts_its_activations_exactly_as_declared(native_isa, k):
    """Read decode's fixed point back out of the native GEMV: row c holds q = 1 at column c
    (scale 1, min 0), so it outputs X[c] u exactly; row k + g holds only min 1 in group g, so it
    outputs group g's sum. Each group's largest |x| is 127 2^j and the rest multiples of
    2^(j-1), so X u and the sums are exact in f32 and narrow X = round(x 2^-j) meets ties; one
    group is zeros, and narrow has one below its floor, which sends its 8-group block of the
    vectorized conversion to the scalar code. k = 576: a block of 8 and a tail of 2 groups;
    2048: two pieces of the conversion the threads share, the second at group 32."""
    if native_isa == native_cpu.TORCH:
        pytest.skip("no native library")
    width = native_cpu.q4nx_activation_bytes(native_isa)
    groups = k // q4nx.GROUP
    g = torch.Generator().manual_seed(k)
    j = torch.randint(-40, 30, (groups, 1), generator=g).double()
    x = torch.randint(-254, 255, (groups, q4nx.GROUP), generator=g).double() * 2.0 ** (j - 1)
    top = torch.randint(0, q4nx.GROUP, (groups,), generator=g)
    x[torch.arange(groups), top] = 127 * 2.0 ** j[:, 0] * torch.where(torch.arange(groups) % 2 == 0, 1.0, -1.0)
    assert ((x * 2.0 ** -j).remainder(1) == 0.5).any()      # ties for narrow's rounding
    x[3] = 0
    if width == q4nx.NARROW:
        x[5] = torch.randint(-127, 128, (q4nx.GROUP,), generator=g).double() * 2.0 ** (q4nx.NARROW_FLOOR_EXP - 8)
    exact, x = x.view(-1), x.view(-1).to(torch.bfloat16)
    assert torch.equal(x.double(), exact)
    n = -(-(k + groups) // q4nx.ROWS) * q4nx.ROWS
    q = torch.zeros(n, k, dtype=torch.uint8)
    q[torch.arange(k), torch.arange(k)] = 1
    scale = torch.zeros(n, groups)
    scale[:k] = 1
    minimum = torch.zeros(n, groups)
    minimum[k + torch.arange(groups), torch.arange(groups)] = 1
    dev = Q4nxPacking(n, k).pack(q4nx.pack(q, scale.bfloat16(), minimum.bfloat16()), _alloc)
    y = torch.empty(n, dtype=torch.bfloat16)
    native_cpu.gemv_q4nx_batch_call([(dev, x, y)])()
    X, u = q4nx.fixed_point(x, width)
    assert torch.equal(y[:k].float(), (X.view(groups, -1) * u[:, None]).view(-1).bfloat16().float())
    assert torch.equal(y[k:k + groups].float(), q4nx.group_sums(x, X, u, width).bfloat16().float())
    if width == q4nx.NARROW:
        assert (X.view(groups, -1)[5] == 0).all() and u[5] == 1


def test_the_gemv_is_the_same_bits_on_every_class_of_one_activation_width():
    """Exact integer sums, combined in one order: every class of one width gives the same bits."""
    classes = native_cpu.supported_isas() + native_cpu.emulated_isas()
    widths = {w: [c for c in classes if native_cpu.q4nx_activation_bytes(c) == w] for w in (q4nx.WIDE, q4nx.NARROW)}
    if all(len(c) < 2 for c in widths.values()):
        pytest.skip("no two ISA classes of one activation width on this CPU")
    n, k = 96, 576
    buf = quantize.quantize(_rand(n, k, seed=11))
    dev = Q4nxPacking(n, k).pack(buf, _alloc)
    x = _rand(k, seed=12, scale=1.0)
    for same in widths.values():
        outs = []
        for isa in same:
            with native_cpu.use_isa(isa):
                y = torch.empty(n, dtype=torch.bfloat16)
                native_cpu.gemv_q4nx_batch_call([(dev, x, y)])()
                outs.append(y)
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), same


def test_native_kernels_refuse_declared_form_bytes_of_the_wrong_size():
    buf = torch.zeros(q4nx.nbytes(32, 64) - 1, dtype=torch.uint8)
    x, y = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(32, dtype=torch.bfloat16)
    assert native_cpu.gemv_q4nx_batch_call([(buf, x, y)]) is None


def test_q4nx_groups_declare_their_weights_as_bytes(tiny_config):
    cfg = tiny_config
    for g in all_groups(cfg, (32,), quant=q4nx.NAME):
        weights = [s for s in g.with_role(Role.STATIC) if len(s.shape) == 2]
        if g.kind == "flash_attn":
            assert not weights and g.quant == "bf16"
            continue
        assert g.name.endswith("_q4nx") and weights
        assert all(s.quantized and s.nbytes == q4nx.nbytes(*s.shape) and s.storage_shape == (s.nbytes,)
                   for s in weights)
        assert {l.op for l in g.launches} & {"gemv_q4nx", "gemm_q4nx"}
        assert not {l.op for l in g.launches} & {"gemv", "gemm"}
    assert QUANTS == ("bf16", q4nx.NAME)
    with pytest.raises(ValueError, match="unknown weight format"):
        build_group("o_gemv_ffn", cfg, quant="q3")


def test_the_lm_head_partitions_are_whole_row_blocks_padded_with_zeros(tiny_config):
    """tests' TINY has a vocabulary of 250: the padded head is 256 rows, 8 partitions of 32."""
    cfg = tiny_config
    w = synthetic_weights(cfg, seed=1)
    head = quantize.quantize(quantize.pad_rows(w.lm_head))
    qw = type(w)(cfg, w.embed, w.final_norm, head, w.layers, quant=q4nx.NAME)
    g = lm_head_gemv(cfg, q4nx.NAME)
    parts = static_tensors(g, qw, None)
    rows = g.slot("w_p0").shape[0]
    assert rows % q4nx.ROWS == 0
    dense = torch.cat([q4nx.dequantize(parts[f"w_p{i}"], rows, cfg.hidden_size) for i in range(8)])
    assert torch.equal(dense[:cfg.vocab_size], q4nx.dequantize(head, head.numel() * 8 // 5 // cfg.hidden_size,
                                                               cfg.hidden_size)[:cfg.vocab_size])
    assert not dense[cfg.vocab_size:].any()


def test_a_batch_sharing_activations_gives_each_job_its_own_product(native_isa):
    """Q, K and V (and the LM head's partitions) share x in one batch: one conversion of x serves
    them, and a job with other activations still gets its own. 2560 columns: each conversion is
    cut in pieces of 1024 for the team, the last one shorter."""
    if native_isa == native_cpu.TORCH:
        pytest.skip("no native library")
    n, k = 64, 2560
    bufs = [quantize.quantize(_rand(n, k, seed=20 + i)) for i in range(3)]
    devs = [Q4nxPacking(n, k).pack(b, _alloc) for b in bufs]
    x, x2 = _rand(k, seed=30, scale=1.0), _rand(k, seed=31, scale=1.0)
    jobs = [(devs[0], x, torch.empty(n, dtype=torch.bfloat16)), (devs[1], x2, torch.empty(n, dtype=torch.bfloat16)),
            (devs[2], x, torch.empty(n, dtype=torch.bfloat16))]
    native_cpu.gemv_q4nx_batch_call(jobs)()
    for (w, xx, y), buf in zip(jobs, bufs):
        alone = torch.empty(n, dtype=torch.bfloat16)
        native_cpu.gemv_q4nx_batch_call([(w, xx, alone)])()
        assert torch.equal(y, alone)
        _matches_decode(y, xx, buf, n, k, native_isa)


@pytest.mark.parametrize("isa", [native_cpu.TORCH, "native"])
def test_the_simulated_ops_compute_the_contract_on_either_path(isa, tiny_config):
    """The launch ops as the device binds them: with no native library (torch) on the declared
    bytes, natively on the device form; both give the reference's numbers."""
    from npu_runtime.sim import ops
    from cpu_kernels.weight_tiles import DeviceQ4nx

    if isa == "native" and not native_cpu.supported_isas():
        pytest.skip("no native library")
    g = build_group("o_gemv_ffn", tiny_config, quant=q4nx.NAME)
    up = next(l for l in g.launches if l.name == "up_proj")
    n, k = g.slot("w_up").shape
    buf = quantize.quantize(_rand(n, k, seed=40))
    x, y = _rand(k, seed=41, scale=1.0), torch.empty(n, dtype=torch.bfloat16)
    p = next(l for l in build_group("o_ffn", tiny_config, 32, quant=q4nx.NAME).launches if l.name == "up_proj")
    a, c = _rand(32, k, seed=42, scale=1.0), torch.empty(32, n, dtype=torch.bfloat16)
    cls = isa if isa == native_cpu.TORCH else native_cpu.supported_isas()[0]
    with native_cpu.use_isa(cls):
        w = buf if isa == native_cpu.TORCH else DeviceQ4nx(Q4nxPacking(n, k).pack(buf, _alloc), n, k)
        ops.bind([up], {"normed": x, "w_up": w, "up": y})()
        ops.bind(p, {"normed": a, "w_up": w, "up": c})()
    _matches_decode(y, x, buf, n, k, cls)
    _matches_prefill_of(cls, c, a, buf, n, k)
