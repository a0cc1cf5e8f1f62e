"""The resident KV cache's launches natively (`resident_kv_bf16_cpu.cc`) under every ISA class
this CPU runs, against their torch bodies (`npu_runtime.sim.ops`: kv_append, decode_attn,
attn_merge), which are the contract, and the merged attention against exact softmax attention.

decode_attn sums in another order than its body's matmuls and uses its own e^x, so a
probability may land one bf16 step from the body's now and then: each split's sums are held
to 2^-7 of their terms' size (Σ p |v|, or the total itself), the merged rows to one ulp at the
size of their terms (`REORDERED`), and to the flash bound against exact attention. The
position is read when the bound call runs, through the i32's address: one binding follows
every new value, and a position outside the cache is refused before anything is read or
written, in a call and in a recorded program. The (KV head, split) items are shared by the
team; every team gives the same bits. A whole fused decode token records as a native program
whose replay is the call-by-call run, to the bit.
"""
from __future__ import annotations

import pytest
import torch

from cpu_kernels import native_cpu
from cpu_kernels.native_program import NativeProgram
from kernel_builder.fused_groups import cache_capacity, fused_decode
from kernel_builder.groups import _launch
from llama_base.config import LlamaConfig
from llama_base.group_contract import Role
from npu_runtime.api import RecordedInput, RecordedOutput, Sync
from npu_runtime.sim import ops
from npu_runtime.sim.device import SimDevice
from seeded import rand_bf16, team
from verify import reference as ref

pytestmark = [pytest.mark.skipif(native_cpu._library() is None,
                                 reason="no C++ compiler or no AVX2 on this CPU: the simulator uses torch"),
              pytest.mark.usefixtures("native_isa")]

# (q heads, KV heads, head dim, chunk, splits): Llama 3.2 1B (group 4) and 3B (group 3, head
# dim 128), groups 1, 2, 5 (a pass of four query heads, then one) and 8, and a head dim of no
# whole 32-dim pair blocks, which takes the kernel's other form.
SHAPES = [(32, 8, 64, 64, 4), (24, 8, 128, 32, 4), (8, 8, 64, 64, 2), (16, 8, 128, 32, 2), (10, 2, 64, 64, 3),
          (32, 4, 128, 32, 4), (6, 2, 80, 64, 2)]
CHUNKS = 8      # capacity of each test's cache, in chunks
# Against exact attention: the contract rounds each probability to bf16 against its split's
# running max, up to half a bf16 step of each weight, so an output may be off by a rounding
# at the size of its terms (`FLASH_ULPS`), and many are: the torch body itself has up to 37 %
# of these shapes' outputs one ulp off (the prefill flash bound allows 30 %).
DECODE_FRACTION = 0.5


class Resident:
    """One layer's resident-cache launches and their views, filled from a seed: the K/V rows of
    a token, the cache, the query, the split sums and the merged row."""

    def __init__(self, hq: int, kvh: int, d: int, chunk: int, splits: int, ctx: int, rows: int = 1, seed: int = 0):
        self.hq, self.kvh, self.d, self.chunk, self.splits, self.ctx, self.rows = hq, kvh, d, chunk, splits, ctx, rows
        group = hq // kvh
        self.append = _launch("L0_kv_append", "kv_append", ["k", "v", "pos"], ["k_cache", "v_cache"], rows=rows,
                              ctx=ctx, kv_heads=kvh, head_dim=d)
        self.attn = _launch("L0_attn", "decode_attn", ["q", "k_cache", "v_cache", "pos"], ["acc", "stats"], ctx=ctx,
                            q_heads=hq, kv_heads=kvh, head_dim=d, chunk=chunk, splits=splits, window=ctx)
        self.merge = _launch("L0_attn_merge", "attn_merge", ["acc", "stats"], ["attn"], q_heads=hq, kv_heads=kvh,
                             head_dim=d, splits=splits)
        self.views = {
            "k": rand_bf16(rows * kvh * d, seed=seed), "v": rand_bf16(rows * kvh * d, seed=seed + 1),
            "pos": torch.zeros(1, dtype=torch.int32),
            "k_cache": rand_bf16(kvh, ctx, d, seed=seed + 2), "v_cache": rand_bf16(kvh, ctx, d, seed=seed + 3),
            "q": rand_bf16(hq * d, seed=seed + 4, scale=2.0),
            "acc": torch.full((kvh, splits, group, d), 7.0), "stats": torch.full((kvh, splits, group, 2), 7.0),
            "attn": torch.zeros(hq * d, dtype=torch.bfloat16),
        }

    def bound(self, *launches):
        """Each launch bound as the simulated device binds it: its native call, checked."""
        calls = [ops.bind(l, self.views) for l in launches]
        assert all(isinstance(c, native_cpu.NativeCall) for c in calls), "a launch bound no native call"
        return calls

    def torch_body(self, launch, views=None) -> None:
        views = self.views if views is None else views
        getattr(ops, launch.op).__wrapped__(launch, *(views[a] for a in launch.args))

    def copy(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.views.items()}

    def tokens(self, n: int) -> tuple[torch.Tensor, ...]:
        """Query, K and V as `reference.attention` takes them: positions 0..n-1, token-major."""
        tok = lambda c: c[:, :n].transpose(0, 1).reshape(n, -1)     # noqa: E731
        return self.views["q"].view(1, -1), tok(self.views["k_cache"]), tok(self.views["v_cache"])


def _lengths(chunk: int, ctx: int) -> list[int]:
    return [1, chunk - 1, chunk, chunk + 1, 5 * chunk + 3, ctx]


def _split_sums_agree(got: dict, want: dict, floor_acc: torch.Tensor, what: str) -> None:
    """acc within 2^-7 of its terms' size (Σ p |v|, `floor_acc`), each split's total within
    2^-7 of itself (its terms are positive), its max to f32 rounding of the scores."""
    assert torch.all((got["acc"] - want["acc"]).abs() <= 2 ** -7 * floor_acc + 1e-30), f"{what}: acc"
    total, want_total = got["stats"][..., 1], want["stats"][..., 1]
    assert torch.all((total - want_total).abs() <= 2 ** -7 * want_total), f"{what}: totals"
    torch.testing.assert_close(got["stats"][..., 0], want["stats"][..., 0], rtol=1e-5, atol=1e-5, msg=what)


@pytest.mark.parametrize("hq,kvh,d,chunk,splits", SHAPES)
def test_decode_attention_matches_its_torch_body_and_exact_attention(hq, kvh, d, chunk, splits):
    r = Resident(hq, kvh, d, chunk, splits, CHUNKS * chunk, seed=hq + d)
    attn, merge = r.bound(r.attn, r.merge)
    for n in _lengths(chunk, r.ctx):
        what = f"{n} positions"
        r.views["pos"][0] = n - 1
        attn()
        merge()
        want = r.copy()
        r.torch_body(r.attn, want)
        r.torch_body(r.merge, want)
        on_abs = {**want, "v_cache": want["v_cache"].abs(), "acc": want["acc"].clone(), "stats": want["stats"].clone()}
        r.torch_body(r.attn, on_abs)                # the split sums' terms' size, Σ p |v|
        _split_sums_agree(r.views, want, on_abs["acc"], what)
        q, k, v = r.tokens(n)
        floor = ref.attention_floor(q, k, v, hq, kvh, q_start=n - 1).view(-1)
        got = r.views["attn"]
        ref.assert_within_ulps(got, want["attn"], 1, ref.REORDERED, floor=floor, what=f"{what}, vs the torch body")
        exact = ref.attention(q, k, v, hq, kvh, q_start=n - 1).view(-1)
        ref.assert_within_ulps(got, exact, ref.FLASH_ULPS, DECODE_FRACTION, floor=floor, what=f"{what}, vs exact")
        if 1 < n <= chunk + 1:      # the token's own key left out is far outside the bound where
            # one key is a sizeable share of the weights (around the first chunk's mask edge)
            missed = ref.attention(q, k[:-1], v[:-1], hq, kvh, q_start=n - 1).view(-1)
            with pytest.raises(AssertionError):
                ref.assert_within_ulps(missed, exact, ref.FLASH_ULPS, DECODE_FRACTION, floor=floor)


@pytest.mark.parametrize("hq,kvh,d,chunk,splits", [SHAPES[0], SHAPES[1], SHAPES[-1]])
def test_nothing_past_the_position_is_read(hq, kvh, d, chunk, splits):
    """NaN in every cache row past the position (the last chunk's masked rows among them)
    changes no bit: those rows are not read."""
    r = Resident(hq, kvh, d, chunk, splits, CHUNKS * chunk, seed=5)
    attn, merge = r.bound(r.attn, r.merge)
    for n in (1, chunk + 1, 3 * chunk - 5):
        r.views["pos"][0] = n - 1
        attn()
        merge()
        want = r.copy()
        for c in ("k_cache", "v_cache"):
            r.views[c][:, n:] = float("nan")
        attn()
        merge()
        for name in ("acc", "stats", "attn"):
            assert torch.equal(r.views[name].view(torch.uint8), want[name].view(torch.uint8)), (n, name)
        for c in ("k_cache", "v_cache"):
            r.views[c][:, n:] = 0


@pytest.mark.parametrize("hq,kvh,d,splits", [(32, 8, 64, 4), (24, 8, 128, 4), (10, 2, 64, 3), (6, 2, 80, 1)])
def test_attn_merge_matches_its_torch_body(hq, kvh, d, splits):
    """Splits of unlike maxima, one of them empty (the mask fill's max, no total, zero sums),
    as a short context leaves the later splits."""
    group = hq // kvh
    g = torch.Generator().manual_seed(hq * d)
    acc = torch.randn(kvh, splits, group, d, generator=g) * 30
    stats = torch.stack([torch.randn(kvh, splits, group, generator=g) * 4,
                         torch.rand(kvh, splits, group, generator=g) * 40 + 1], -1)
    if splits > 1:
        acc[:, -1], stats[:, -1, :, 0], stats[:, -1, :, 1] = 0, ops.MASK_FILL, 0
    out, want = torch.empty(hq * d, dtype=torch.bfloat16), torch.empty(hq * d, dtype=torch.bfloat16)
    l = _launch("merge", "attn_merge", ["acc", "stats"], ["attn"], q_heads=hq, kv_heads=kvh, head_dim=d, splits=splits)
    call = ops.bind(l, {"acc": acc, "stats": stats, "attn": out})
    assert isinstance(call, native_cpu.NativeCall)
    call()
    ops.attn_merge.__wrapped__(l, acc, stats, want)
    w = torch.exp(stats[..., 0] - stats[..., 0].amax(1, keepdim=True))
    floor = ((acc.abs() * w[..., None]).sum(1) / (stats[..., 1] * w).sum(1)[..., None]).reshape(-1)
    ref.assert_within_ulps(out, want, 1, ref.REORDERED, floor=floor)


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("kvh,d", [(8, 64), (8, 128), (3, 80)])
def test_kv_append_writes_what_its_torch_body_writes(rows, kvh, d):
    """Rows at the cache's start, inside it and ending at its last position: the same cache
    bytes, every position the rows do not cover kept."""
    r = Resident(kvh, kvh, d, 64, 1, 256, rows=rows, seed=rows + d)
    (append,) = r.bound(r.append)
    for start in (0, 7, r.ctx - rows):
        r.views["pos"][0] = start
        want = r.copy()
        append()
        r.torch_body(r.append, want)
        for c in ("k_cache", "v_cache"):
            assert torch.equal(r.views[c].view(torch.int16), want[c].view(torch.int16)), (start, c)


def test_the_position_is_read_when_the_call_runs():
    """Bound once, the append, the attention and the merge follow the i32 from token to token:
    each step's cache and results are those of calls bound anew at that position, to the bit,
    and of the torch bodies within their bounds."""
    r = Resident(32, 8, 64, 64, 4, 512, seed=9)
    bound = r.bound(r.append, r.attn, r.merge)
    theirs = r.copy()
    g = torch.Generator().manual_seed(1)
    for pos in (0, 1, 2, 63, 64, 65, 200, 511, 3, 130):
        for name in ("k", "v"):
            r.views[name].copy_(torch.randn(r.views[name].numel(), generator=g))
            theirs[name].copy_(r.views[name])
        r.views["pos"][0] = theirs["pos"][0] = pos
        for call in bound:
            call()
        fresh = Resident(32, 8, 64, 64, 4, 512)
        fresh.views = {name: t.clone() for name, t in theirs.items()}
        for call in fresh.bound(fresh.append, fresh.attn, fresh.merge):
            call()
        for name in ("k_cache", "v_cache", "acc", "stats", "attn"):
            assert torch.equal(r.views[name].view(torch.uint8), fresh.views[name].view(torch.uint8)), (pos, name)
        for l in (r.append, r.attn, r.merge):
            r.torch_body(l, theirs)
        ref.assert_within_ulps(r.views["attn"], theirs["attn"], 1, ref.REORDERED,
                               floor=theirs["attn"].float().abs().amax(), what=f"position {pos}")
        theirs = fresh.views


def _outside(r: Resident) -> list[tuple[object, int, str]]:
    """(launch, position, the torch body's message) for positions outside r's cache."""
    big, small = 2 ** 31 - 1, -2 ** 31
    rows = [(r.append, at, f"{r.rows} rows at position {at} do not fit a {r.ctx}-position cache")
            for at in (-1, r.ctx - r.rows + 1, big, small)]
    return rows + [(r.attn, p, f"position {p} is outside a {r.ctx}-position window") for p in (-1, r.ctx, big, small)]


@pytest.mark.parametrize("rows", [1, 16])
def test_a_position_outside_the_cache_is_refused_before_anything_is_written(rows):
    """The bound call raises what the torch body raises, and nothing it would write has
    changed; so does a recorded program that replays it (it checks the calls' status after
    its run). Positions past the cache, before it, and the i32's extremes."""
    r = Resident(32, 8, 64, 64, 4, 256, rows=rows, seed=3)
    for launch, position, message in _outside(r):
        (call,) = r.bound(launch)
        prog = NativeProgram.new()
        prog.bound(call)
        r.views["pos"][0] = position
        before = r.copy()
        for run in (call, lambda: prog.run(0)):
            with pytest.raises(IndexError, match=f"^{launch.name}: {message}$"):
                run()
            for name, t in before.items():
                assert torch.equal(r.views[name].view(torch.uint8), t.view(torch.uint8)), (launch.name, position, name)
        with pytest.raises(IndexError, match=f"^{launch.name}: {message}$"):
            r.torch_body(launch, r.copy())
        r.views["pos"][0] = 0
        call()                          # a position inside again: it runs, and says nothing
        prog.run(0)


@pytest.mark.parametrize("hq,kvh,d,chunk,splits", [(32, 8, 64, 64, 4), (9, 3, 128, 32, 2), (4, 1, 64, 64, 1)])
def test_every_team_gives_the_same_bits(hq, kvh, d, chunk, splits):
    """A long context's (KV head, split) items shared by teams of 1 to 5 threads, some of whom
    get parts of one head's splits, or none: the same bits, since each split's sums run in one
    order whoever computes them."""
    r = Resident(hq, kvh, d, chunk, splits, 4096, seed=kvh)
    attn, merge = r.bound(r.attn, r.merge)
    want = {}
    for threads in (1, 2, 3, 5):
        with team(threads):
            for n in (300, 2500, 4096):
                r.views["pos"][0] = n - 1
                attn()
                merge()
                got = [r.views[name].clone() for name in ("acc", "stats", "attn")]
                for a, b in zip(want.setdefault(n, got), got):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (threads, n)


# A decode group of two layers on head dims of both kernel forms: 16 (no whole pair blocks)
# and 64.
def _config(head_dim: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=head_dim, intermediate_size=256, vocab_size=250, max_position_embeddings=1024,
                       bos_token_id=1, eos_token_ids=(2,))


def _loaded(group, tmp_path, seed: int):
    """The group loaded on a simulated device, every buffer but the state filled from `seed`
    (its weights packed as the GEMVs read them)."""
    dev = SimDevice()
    tmp_path.mkdir()
    dev.compile(group, tmp_path, "")
    kernel = dev.load(tmp_path, group)
    bos = [dev.bo(s.nbytes, kernel, i) for i, s in enumerate(group.slots)]
    for i, (slot, bo) in enumerate(zip(group.slots, bos)):
        if slot.role in (Role.STATIC, Role.INPUT) and slot.dtype == "bf16":
            bo.write(rand_bf16(slot.nbytes // 2, seed=seed + i, scale=0.2))
            bo.sync(Sync.TO_DEVICE)
    return dev, kernel, bos


@pytest.mark.parametrize("head_dim", [16, 64])
def test_a_fused_decode_token_records_and_its_replay_is_the_run(tmp_path, head_dim):
    """A whole token (`fused_decode`: every layer's append, attention and merge on its
    resident cache) bound launch by launch, and recorded once as a native program that takes
    the position from a table each run: at every position the same outputs and the same
    caches, to the bit. The program has no step a position for the resident kernels; a
    position past the cache raises from the replay too."""
    cfg = _config(head_dim)
    capacity = cache_capacity(cfg, 96, 32)
    group = fused_decode(cfg, capacity)
    (_, k_loop, loop), (_, k_rec, rec) = (_loaded(group, tmp_path / name, seed=4) for name in ("loop", "rec"))
    names = [s.name for s in group.slots]
    at = lambda bos, name: bos[names.index(name)]       # noqa: E731
    outputs = [s.name for s in group.slots if s.role is Role.OUTPUT]
    states = [s.name for s in group.slots if s.role is Role.STATE]
    functions = {c.func.__name__ for c in k_rec._program(rec)}
    # A session's device runs each decode attention and its merge as the host attention's one
    # call (`ops.AttendStep`), reading its position through a pointer as the others do.
    assert {"kv_append_bf16_cpu", "attention_at_bf16_cpu"} <= functions

    table = torch.arange(capacity + 1, dtype=torch.int32)
    prog = NativeProgram.new()
    k_rec.record(prog, rec, [RecordedInput(at(rec, "pos"), 4, table.data_ptr(), 4)],
                 [RecordedOutput(at(rec, n), group.slot(n).nbytes) for n in outputs])
    prog.hold(table)
    for pos in range(40):
        at(loop, "pos").write(torch.tensor([pos], dtype=torch.int32))
        at(loop, "pos").sync(Sync.TO_DEVICE)
        k_loop.run(loop)
        prog.run(pos)
        for n in outputs:
            at(loop, n).sync(Sync.FROM_DEVICE)
            assert torch.equal(at(loop, n).read(), at(rec, n).read()), (pos, n)
        for n in states:
            assert torch.equal(at(loop, n).device_view(False), at(rec, n).device_view(False)), (pos, n)
    rows = at(rec, "L0_k_cache").device_view(False)[:group.slot("L0_k_cache").nbytes]
    written = rows.view(torch.int16).view(cfg.num_key_value_heads, capacity, head_dim).ne(0).any(-1)
    assert written[:, :40].all() and not written[:, 40:].any()      # each token's row at its own position
    with pytest.raises(IndexError, match="L0_kv_append: 1 rows at position"):
        prog.run(capacity)
