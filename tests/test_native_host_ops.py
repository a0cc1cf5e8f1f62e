"""The simulator's elementwise launches and the host's two attentions, natively (every ISA class
this CPU runs) and on their torch path, each against `reference`.

RoPE and add round exactly as the reference does, so they must match every bit. RMSNorm sums
squares in another order and SwiGLU uses its own exp, so they may differ by one bf16 unit,
rarely. Shapes cover decode rows, vector tails (widths not a multiple of 16) and prefill sizes
large enough to run in parallel; SwiGLU also sees overflow, zeros and NaN. Each comparison
also fails on a mistake the bound must catch (a rounding missed, a mask one key off).
"""
from __future__ import annotations

import ctypes
import functools

import pytest
import torch

from cpu_kernels import native_cpu, native_rows
from kernel_builder.groups import build_group
from verify import reference as ref
from llama_runtime.engine.device_model import rms_norm
from llama_runtime.engine.kv_cache import KVCache, decode_attention_cpu
from npu_runtime.sim import ops as sim_ops
from npu_runtime.sim.device import SimDevice

pytestmark = [pytest.mark.skipif(native_cpu._library() is None,
                                 reason="no C++ compiler or no AVX2/AVX512-BF16 on this CPU: the simulator uses torch"),
              pytest.mark.usefixtures("native_isa")]   # every ISA class this CPU runs


class _Launch:
    def __init__(self, **params):
        self.params = params

    def p(self, key):
        return self.params[key]


def _native_and_torch(monkeypatch, name: str, run, out: torch.Tensor):
    """`run` with native_cpu.<name> as it is (which must take the native path), then without it."""
    taken = []
    real = getattr(native_cpu, name)
    with monkeypatch.context() as m:
        m.setattr(native_cpu, name, lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
        run(out)
    assert taken and all(taken), f"native_cpu.{name} was not used"
    native = out.clone()
    with monkeypatch.context() as m:
        m.setattr(native_cpu, name, lambda *a, **k: None)   # "no native kernel"
        out.fill_(0)
        run(out)
    return native, out.clone()


@pytest.mark.parametrize("rows,dim", [(1, 2048), (1, 100), (3, 576), (64, 2048)])
def test_every_rmsnorm_rounds_where_hf_does(monkeypatch, rows, dim):
    """The simulator's native and torch RMSNorm and the host's final norm round the normalised
    row to bf16 before the weight multiply, as HF and the MLIR launch do. They may differ from
    the reference only where the f32 sum of squares, summed in another order, moves a value
    across a rounding boundary (`REORDERED`); a norm that rounds once is an ulp off in about a
    quarter of the elements and fails."""
    g = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
    w = (torch.randn(dim, generator=g) * 2).bfloat16()
    want = ref.rms(x, w, 1e-5)
    l = _Launch(dim=dim, eps=1e-5)
    native, fallback = _native_and_torch(monkeypatch, "rmsnorm_call", lambda o: sim_ops.rmsnorm(l, x, w, o),
                                         torch.empty_like(x))
    for what, got in (("native", native), ("torch", fallback), ("host", rms_norm(x, w, 1e-5))):
        ref.assert_within_ulps(got, want, 1, ref.REORDERED, what=what)
    one_rounding = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).bfloat16()
    with pytest.raises(AssertionError, match="differ"):
        ref.assert_within_ulps(one_rounding, want, 1, ref.REORDERED)


@pytest.mark.parametrize("n", [8192, 1000, 128 * 8192])
def test_swiglu(monkeypatch, n):
    """The native kernel's own exp is within an ulp of torch's f32 silu, rarely off
    (`REORDERED`); the torch body rounds as the reference does. NaN stays NaN where the
    reference's is; ±1e30, ±0 and saturation are compared like any value. Rounding silu(gate)
    to bf16 before the product (a second rounding) fails."""
    g = torch.Generator().manual_seed(n)
    gate = (torch.randn(n, generator=g) * 4).bfloat16()
    gate[:7] = torch.tensor([-100.0, -1e30, 1e30, 90.0, float("nan"), 0.0, -0.0])
    up = torch.randn(n, generator=g).bfloat16()
    want = ref.swiglu(gate, up)
    native, fallback = _native_and_torch(monkeypatch, "swiglu_call", lambda o: sim_ops.swiglu(None, gate, up, o),
                                         torch.empty_like(gate))
    ref.assert_within_ulps(native, want, 1, ref.REORDERED, what="native")
    ref.assert_within_ulps(fallback, want, 0, what="torch")
    twice = (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
    with pytest.raises(AssertionError, match="differ"):
        ref.assert_within_ulps(twice, want, 1, ref.REORDERED)


@pytest.mark.parametrize("n", [2048, 1000, 128 * 2048])
def test_add_is_bit_exact(monkeypatch, n):
    g = torch.Generator().manual_seed(n)
    a, b = (torch.randn(n, generator=g) * 100).bfloat16(), torch.randn(n, generator=g).bfloat16()
    native, fallback = _native_and_torch(monkeypatch, "add_call", lambda o: sim_ops.add(None, a, b, o),
                                         torch.empty_like(a))
    for what, got in (("native", native), ("torch", fallback)):
        ref.assert_within_ulps(got, ref.add(a, b), 0, what=what)


@pytest.mark.parametrize("rows,heads,head_dim", [(1, 32, 64), (3, 4, 16), (2, 3, 20), (64, 32, 64)])
def test_rope_is_bit_exact(monkeypatch, rows, heads, head_dim):
    """Both paths round each rotated value as the reference does (exact products, one f32 sum);
    a rotation the other way (sin negated) fails."""
    g = torch.Generator().manual_seed(rows * heads)
    x = torch.randn(rows, heads * head_dim, generator=g).bfloat16()
    lut = torch.randn(rows, head_dim, generator=g).bfloat16()
    want = ref.rope(x, lut, heads)
    l = _Launch(rows=rows, heads=heads, head_dim=head_dim)
    native, fallback = _native_and_torch(monkeypatch, "rope_call", lambda o: sim_ops.rope(l, x, lut, o),
                                         torch.empty_like(x))
    for what, got in (("native", native), ("torch", fallback)):
        ref.assert_within_ulps(got, want, 0, what=what)
    h = head_dim // 2
    with pytest.raises(AssertionError):
        ref.assert_within_ulps(ref.rope(x, torch.cat([lut[:, :h], -lut[:, h:]], -1), heads), want, 0)


@pytest.mark.parametrize("heads,kv_heads,head_dim,pos", [
    (32, 8, 64, 0), (32, 8, 64, 300),      # Llama 3.2 1B's heads; one position, and a parallel pass
    (6, 2, 20, 17), (4, 4, 16, 40),        # head dims known only at run time; groups of 3 and 1
    (8, 2, 128, 100), (4, 4, 32, 5),       # the other compiled head dims
    (10, 2, 64, 70),                       # a group of 5: a chunk of 4 heads, then 1
    (9, 3, 64, 1100), (4, 1, 20, 2600),    # few KV heads at long contexts: segments of positions, merged
    (32, 8, 64, 1500),                     # many: segments whose V fits the core's L2
])
def test_decode_attention_matches_the_reference(monkeypatch, heads, kv_heads, head_dim, pos):
    """The host's single-query attention, native and torch, against `reference.attention`: f32
    throughout, summed in another order (`REORDERED`), each output measured at the size of its
    terms Σ p |v|. The native kernel takes a KV head's query heads in chunks,
    compiled for the common head dims. Attending to one key fewer (the token's own) fails."""
    g = torch.Generator().manual_seed(pos + head_dim)
    cache = KVCache(2, kv_heads, max(320, pos + 20), head_dim)
    k = torch.randn(pos + 1, kv_heads * head_dim, generator=g).bfloat16()
    v = torch.randn(pos + 1, kv_heads * head_dim, generator=g).bfloat16()
    cache.write(1, 0, k, v)
    cache.k[1, :, pos + 1:].fill_(float("nan"))        # past the position: must never be read
    q = (torch.randn(heads * head_dim, generator=g) * 2).bfloat16()
    want = ref.attention(q.view(1, -1), k, v, heads, kv_heads, q_start=pos).view(-1)
    floor = ref.attention_floor(q.view(1, -1), k, v, heads, kv_heads, q_start=pos).view(-1)
    native, fallback = _native_and_torch(monkeypatch, "decode_attention",
                                         lambda o: o.copy_(decode_attention_cpu(q, cache, 1, pos, heads)),
                                         torch.empty(heads * head_dim, dtype=torch.bfloat16))
    for what, got in (("native", native), ("torch", fallback)):
        ref.assert_within_ulps(got, want, 1, ref.REORDERED, floor=floor, what=what)
    if pos:
        own_key_missed = ref.attention(q.view(1, -1), k[:pos], v[:pos], heads, kv_heads, q_start=pos).view(-1)
        with pytest.raises(AssertionError):
            ref.assert_within_ulps(own_key_missed, want, 1, ref.REORDERED, floor=floor)


def test_a_decode_steps_store_and_attention_are_the_write_and_the_attention(monkeypatch):
    """`KVCache.store_and_attend`, the decode step's bound host op, stores the rows and attends
    exactly as `write` then `decode_attention_cpu` do, natively and on the torch path: the same
    cache bytes and the same output bits. It binds each query view once; a layer with views of
    its own, and new row tensors for a view it has seen, are bound anew, not confused with them.
    A layer or position outside the cache raises before anything is written."""
    g = torch.Generator().manual_seed(11)
    layers, kvh, heads, d, seq = 3, 2, 8, 64, 200
    ours, theirs = KVCache(layers, kvh, seq, d), KVCache(layers, kvh, seq, d)
    views = [tuple(torch.empty(n, dtype=torch.bfloat16) for n in (heads * d, kvh * d, kvh * d)) for _ in range(layers)]

    def step(layer: int, pos: int, q, k, v) -> None:
        for t, scale in ((q, 2), (k, 1), (v, 1)):
            t.copy_(torch.randn(t.numel(), generator=g) * scale)
        got = ours.store_and_attend(layer, pos, q, k, v, heads).clone()
        theirs.write(layer, pos, k.view(1, -1), v.view(1, -1))
        assert torch.equal(got, decode_attention_cpu(q, theirs, layer, pos, heads)), (layer, pos)
        assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)

    for pos in range(0, 150, 7):                # past 128 positions the native kernel splits the heads
        for layer in range(layers):
            step(layer, pos, *views[layer])
    step(1, 150, *(torch.empty_like(t) for t in views[1]))     # fresh rows for layer 1
    step(2, 151, views[2][0], *(torch.empty_like(t) for t in views[2][1:]))   # a seen query, new K/V rows
    for layer, pos in ((layers, 5), (-1, 5), (0, seq), (0, -1)):
        before = ours.k.clone()
        with pytest.raises(IndexError, match="KV cache holds 3 layers of 200 positions"):
            ours.store_and_attend(layer, pos, *views[0], heads)
        assert torch.equal(ours.k, before)
    with monkeypatch.context() as m:            # the torch path: no native step to bind
        m.setattr(native_cpu, "decode_step_calls", lambda *a: None)
        m.setattr(native_cpu, "decode_attention", lambda *a: False)
        m.setattr(native_cpu, "kv_store_row", lambda *a: False)
        ours._steps.clear()
        for layer in range(layers):
            step(layer, 160, *views[layer])


@pytest.mark.parametrize("seq,ctx,heads,kv_heads,head_dim,start", [
    (128, 128, 32, 8, 64, 0),       # a prefill bucket from position 0
    (37, 37, 4, 2, 64, 0),          # rows not a multiple of the 16-query tile, keys of the 64-key block
    (32, 160, 8, 8, 128, 60),       # a chunk at an offset, context bucket past its last position
    (16, 256, 6, 3, 64, 200),       # the last chunk of a long prompt
])
def test_flash_attention_matches_the_reference(monkeypatch, seq, ctx, heads, kv_heads, head_dim, start):
    """Prefill attention, native and torch's fused kernel, against `reference.flash_attention`
    within the flash bound (`FLASH_ULPS`), each output measured at the size of its terms. Cache rows past the
    chunk's last position hold stale values; masked, they must not change an output, and the
    native kernel does not read them at all (NaN there changes nothing). A mask that lets each
    query see one key more fails."""
    g = torch.Generator().manual_seed(seq + start)
    end = min(ctx, start + seq)
    k = (torch.randn(kv_heads, ctx, head_dim, generator=g) * 2).bfloat16()
    v = (torch.randn(kv_heads, ctx, head_dim, generator=g) * 1e3).bfloat16()
    v[:, :end] /= 1e3
    q = (torch.randn(seq, heads * head_dim, generator=g) * 2).bfloat16()
    l = _Launch(seq=seq, ctx=ctx, q_heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    q_start = torch.tensor([start], dtype=torch.int32)
    rows = end - start                  # query rows whose positions are inside the cache
    tok = lambda t: t[:, :end].transpose(0, 1).reshape(end, -1)    # noqa: E731
    args = (q[:rows], tok(k), tok(v), heads, kv_heads)
    want, floor = ref.flash_attention(*args, q_start=start), ref.attention_floor(*args, q_start=start)
    assert native_cpu.flash_attention(q.view(seq, heads, head_dim), k, v, start, torch.empty_like(q).view(seq, heads, -1))
    run = lambda o: sim_ops.flash_attn(l, q, k, v, q_start, o)     # noqa: E731
    native, fallback = _native_and_torch(monkeypatch, "flash_attention", run, torch.empty_like(q))
    for what, got in (("native", native), ("torch", fallback)):
        ref.assert_within_ulps(got[:rows], want, ref.FLASH_ULPS, ref.FLASH_FRACTION, floor=floor, what=what)
    with pytest.raises(AssertionError):
        ref.assert_within_ulps(ref.flash_attention(*args, q_start=start + 1), want, ref.FLASH_ULPS, ref.FLASH_FRACTION,
                               floor=floor)
    k[:, end:], v[:, end:] = float("nan"), float("nan")
    again = torch.empty_like(q)
    run(again)
    assert torch.equal(again[:rows].view(torch.int16), native[:rows].view(torch.int16))


@pytest.mark.parametrize("kind", ["rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv"])
def test_decode_groups_replay_only_native_kernels(tiny_config, tiny_weights, tmp_path, kind):
    """What makes a decode call cheap: once bound to a BO set, every step of the group's plan is a
    native kernel with its pointers fixed, with no Python op left between them. (Its weights
    are allocated for their arguments, so the device holds them packed, as the GEMVs read them.)"""
    dev = SimDevice()
    g = build_group(kind, tiny_config)
    dev.compile(g, tmp_path, "")
    kernel = dev.load(tmp_path, g)
    bos = [dev.bo(s.nbytes, kernel, i) for i, s in enumerate(g.slots)]
    assert any(bo.packing for bo in bos)
    kernel.run(bos)
    program = kernel._program(bos)
    assert len(program) == len(sim_ops.plan(g.launches))
    assert all(isinstance(c, functools.partial) and isinstance(c.func, ctypes._CFuncPtr) for c in program)


def _bound_calls():
    """(name, bind, operands, expected result) for bound forms whose operands nothing else holds."""
    from cpu_kernels.weight_tiles import Q4nxPacking
    from llama_runtime.checkpoints import quantize
    g = torch.Generator().manual_seed(3)
    n, k = 64, 128
    rand = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
    a, b, lut = rand(k), rand(k), rand(1, 32)
    buf = quantize.quantize(rand(n, k))
    w = Q4nxPacking(n, k).pack(buf, lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    out = lambda m: torch.empty(m, dtype=torch.bfloat16)
    yield "add", native_cpu.add_call, [a, b, out(k)], (a.float() + b.float()).to(torch.bfloat16)
    yield "rope", lambda *t: native_cpu.rope_call(*t, 1, 4, 32), [a, lut, out(k)], \
        ref.rope(a, lut, 4).reshape(-1)
    isa = native_cpu._library().isa
    yield "gemv_q4nx", lambda *t: native_cpu.gemv_q4nx_batch_call([tuple(t)]), [w, a, out(n)], \
        ref.gemv_q4nx(a, buf, native_cpu.q4nx_activation_bytes(isa))


@pytest.mark.parametrize("case", ["add", "rope", "gemv_q4nx"])
def test_a_bound_call_holds_its_operands(case):
    """The simulated device binds each native kernel to its buffers once and replays it: the
    binding, not its maker, must keep them, or a replay writes into freed memory."""
    import gc
    import weakref
    name, bind, operands, expected = next(c for c in _bound_calls() if c[0] == case)
    call = bind(*operands)
    refs = [weakref.ref(t) for t in operands]
    del operands
    gc.collect()
    assert all(r() is not None for r in refs), name
    call()
    assert torch.equal(refs[-1]().view(torch.int16), expected.view(torch.int16)), name
    del call
    gc.collect()
    assert all(r() is None for r in refs), name


def _top_k_reference(x: torch.Tensor, k: int) -> list[int]:
    """The k ids of the largest values, the lower id first among equal ones, NaN never."""
    values = x.tolist()
    ranked = sorted((i for i, v in enumerate(values) if v == v), key=lambda i: (-values[i], i))
    return sorted(ranked[:k])


@pytest.mark.parametrize("n,k", [(128256, 256), (5000, 256), (300, 256), (256, 256), (40, 1)])
def test_top_k_ids_chooses_what_torch_chooses(n, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    ids = native_rows.top_k_ids(x, k)
    assert sorted(ids.tolist()) == sorted(torch.topk(x, k).indices.tolist()) == _top_k_reference(x, k)



@pytest.mark.parametrize("case", ["sampled-largest", "sampled-nan", "ascending", "descending"])
def test_top_k_ids_does_not_depend_on_the_sample_its_bound_comes_from(case):
    """The scan keeps what a bound taken from evenly spaced values passes; where fewer than k
    pass (the sample held the largest values) or the sample is NaN, the answer must not change."""
    n, k = 128256, 256
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    sampled = torch.arange(1024) * (n // 1024)
    if case == "sampled-largest":
        x[sampled] = 100.0 + torch.arange(1024.0)
    elif case == "sampled-nan":
        x[sampled] = float("nan")
    else:
        x = x.sort(descending=case == "descending").values
    assert sorted(native_rows.top_k_ids(x, k).tolist()) == _top_k_reference(x, k)

def test_top_k_ids_breaks_ties_by_the_lower_id_and_never_takes_nan():
    """Ties at the k-th value (a quantized head's logits repeat) must resolve the same on every
    class and run; the running floor must not let a later equal value displace an earlier one."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 6, (20000,), generator=g).float()      # thousands of each value
    x[torch.randint(0, 20000, (500,), generator=g)] = float("nan")
    x[7], x[19999] = float("-inf"), float("inf")
    for k in (1, 3, 256, 5000):
        assert sorted(native_rows.top_k_ids(x, k).tolist()) == _top_k_reference(x, k)
    few = torch.full((300,), float("nan"))
    few[:10] = torch.arange(10.0)
    few[20] = float("-inf")
    assert sorted(native_rows.top_k_ids(few, 11).tolist()) == list(range(10)) + [20]
    assert native_rows.top_k_ids(few, 12) is None                # fewer than k values to choose


@pytest.mark.parametrize("n,k", [(256, 2048), (256, 576), (5, 100), (1, 8)])
def test_rows_dot_is_the_f32_product_of_the_bf16_rows(n, k):
    """A rescoring's exact logits: every row's products summed in f32 (in an order of its own,
    so within f32 rounding of the exact sum, with the tail past whole 16-lane steps included)."""
    g = torch.Generator().manual_seed(k)
    rows = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(k, generator=g).bfloat16()
    got = native_rows.rows_dot(rows, x)
    exact = rows.double() @ x.double()
    size = rows.double().abs() @ x.double().abs()
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert torch.all((got.double() - exact).abs() <= size * k * 2.0 ** -24)
    rows[:, -1] = 0                                        # the tail counts: a change there shows
    assert not torch.equal(native_rows.rows_dot(rows, x), got)
