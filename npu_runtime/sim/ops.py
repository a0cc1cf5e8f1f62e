"""Reference kernels of the simulated NPU: one function per launch op.

Each computes what the NPU kernel computes — bf16 operands, f32 accumulation and f32
elementwise math — and rounds once to bf16 when it stores its result, which is where the NPU
rounds too (at every launch boundary). They write into the output view in place, so a run
allocates only small f32 temporaries.

Signature: `op(launch, *views)` with views in `launch.args` order (reads, then writes). A
weight the device holds packed (`weight_tiles`) arrives as a `PackedWeight`. GEMMs, GEMVs,
elementwise ops and attention run natively (`native_cpu`) where the CPU allows: the GEMMs and
GEMVs on packed weights, the rest in one pass with no temporaries, which matters most in decode,
where torch's per-op overhead outweighs a row's arithmetic. The torch bodies are the same math;
they work through rows in blocks whose f32 temporaries stay in cache, several times faster on
a 2048-row prompt than widening whole tensors. `bind` fixes a plan step to one BO set's views,
so the device replays a decode call as a list of native calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial, wraps
from typing import Callable

import torch
import torch.nn.functional as F

from cpu_kernels import native_cpu
from cpu_kernels.weight_tiles import DeviceQ4nx, PackedWeight, declared_q4nx, dense
from llama_base.group_contract import Launch
from llama_base import q4nx

_BLOCK_ELEMS = 1 << 19        # f32 temporaries of 2 MiB: resident in L2/L3 while used


def _row_blocks(rows: int, width: int):
    step = max(1, _BLOCK_ELEMS // width)
    for i in range(0, rows, step):
        yield slice(i, min(rows, i + step))


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    return t.view(-1, width)


def _native(binder: Callable[..., Callable[[], None] | None]):
    """Make an op run `binder`'s native kernel where the CPU has it, else the torch body below it.

    `op.native` stays reachable, so the simulated device can bind the kernel to a BO set's
    views once (`bind`) and replay it, instead of re-checking operands on every call.
    """
    def wrap(reference):
        @wraps(reference)
        def op(l: Launch, *views: torch.Tensor) -> None:
            call = binder(l, *views)
            if call is None:
                reference(l, *views)
            else:
                call()
        op.native = binder
        return op
    return wrap


@_native(lambda l, x, w, out: native_cpu.rmsnorm_call(x, w, out, l.p("dim"), l.p("eps")))
def rmsnorm(l: Launch, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    d = l.p("dim")
    xs, os = _rows(x, d), _rows(out, d)
    for b in _row_blocks(xs.shape[0], d):
        # HF's rounding points: the normalised row to bf16, then the bf16 product with the weight.
        torch.mul(F.rms_norm(xs[b].float(), (d,), eps=l.p("eps")).to(torch.bfloat16), w, out=os[b])


def _packed(w: torch.Tensor | PackedWeight) -> torch.Tensor | None:
    return w.data if isinstance(w, PackedWeight) else None


def _gemv_call(jobs) -> Callable[[], None] | None:
    packed = [(_packed(w), x, y) for w, x, y in jobs]
    return None if any(p is None for p, _, _ in packed) else native_cpu.gemv_batch_call(packed)


@_native(lambda l, a, w, out: None if _packed(w) is None else native_cpu.gemm_call(a, _packed(w), out))
def gemm(l: Launch, a: torch.Tensor, w: torch.Tensor | PackedWeight, out: torch.Tensor) -> None:
    """C[M,N] = A[M,K] · W[N,K]ᵀ: natively on packed weights, else torch's bf16 GEMM (f32 accumulation)."""
    torch.mm(a, dense(w).t(), out=out)


@_native(lambda l, x, w, out: _gemv_call([(w, x, out)]))
def gemv(l: Launch, x: torch.Tensor, w: torch.Tensor | PackedWeight, out: torch.Tensor) -> None:
    """y[M] = W[M,K] · x[K]: natively memory-bound, as on the NPU; torch's bf16 product (the
    fallback) is compute-bound on CPUs without AMX."""
    torch.mv(dense(w), x, out=out)


def _device_q4nx(w: torch.Tensor | DeviceQ4nx) -> torch.Tensor | None:
    """The device-form bytes the native Q4NX kernels read; None for declared-form bytes."""
    return w.data if isinstance(w, DeviceQ4nx) else None


def _gemv_q4nx_call(jobs) -> Callable[[], None] | None:
    dev = [(_device_q4nx(w), x, y) for w, x, y in jobs]
    return None if any(w is None for w, _, _ in dev) else native_cpu.gemv_q4nx_batch_call(dev)


@_native(lambda l, x, w, out: _gemv_q4nx_call([(w, x, out)]))
def gemv_q4nx(l: Launch, x: torch.Tensor, w: torch.Tensor | DeviceQ4nx, out: torch.Tensor) -> None:
    """y[M] = W[M,K] · x[K] with W in Q4NX, dequantization folded into the sums
    (`q4nx.gemv_reference`: the contract the native kernels meet bit for bit in their sums)."""
    out.copy_(q4nx.gemv_reference(declared_q4nx(w), x, l.p("M"), l.p("K")))


def _gemm_q4nx_call(l: Launch, a: torch.Tensor, w: torch.Tensor | DeviceQ4nx, out: torch.Tensor,
                    integer: bool | None = None) -> Callable[[], None] | None:
    """The native Q4NX GEMM on device-form weights; `integer` as `native_cpu.gemm_q4nx_call`'s
    (None: the class's own choice)."""
    dev = _device_q4nx(w)
    return None if dev is None else native_cpu.gemm_q4nx_call(a, dev, out, integer)


@_native(_gemm_q4nx_call)
def gemm_q4nx(l: Launch, a: torch.Tensor, w: torch.Tensor | DeviceQ4nx, out: torch.Tensor) -> None:
    """C[M,N] = A[M,K] · W[N,K]ᵀ with W in Q4NX: W dequantized to bf16 (`q4nx.dequantize`),
    then the bf16 product with f32 accumulation, as the NPU's prefill runs it. The native
    classes where byte products beat the float GEMM (`native_cpu.integer_q4nx_gemm`: AVX2) run
    decode's contract on every row instead (`q4nx.gemv_reference`'s numbers, rounded to bf16)."""
    torch.mm(a, q4nx.dequantize(declared_q4nx(w), l.p("N"), l.p("K")).t(), out=out)


@_native(lambda l, x, lut, out: native_cpu.rope_call(x, lut, out, l.p("rows"), l.p("heads"), l.p("head_dim")))
def rope(l: Launch, x: torch.Tensor, lut: torch.Tensor, out: torch.Tensor) -> None:
    """Half-split rotation of every head by its position's angles (LUT row = cos | sin)."""
    rows, heads, d = l.p("rows"), l.p("heads"), l.p("head_dim")
    h = d // 2
    xs, ls, os = x.view(rows, heads, d), lut.view(rows, 1, d), out.view(rows, heads, d)
    for b in _row_blocks(rows, heads * d):
        xf, lf = xs[b].float(), ls[b].float()
        cos, sin = lf[..., :h], lf[..., h:]
        x1, x2 = xf[..., :h], xf[..., h:]
        os[b, :, :h].copy_(x1 * cos - x2 * sin)
        os[b, :, h:].copy_(x2 * cos + x1 * sin)


@_native(lambda l, gate, up, out: native_cpu.swiglu_call(gate, up, out))
def swiglu(l: Launch, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    width = gate.shape[-1]
    gs, us, os = _rows(gate, width), _rows(up, width), _rows(out, width)
    for b in _row_blocks(gs.shape[0], width):
        torch.mul(F.silu(gs[b].float()), us[b], out=os[b])


@_native(lambda l, a, b, out: native_cpu.add_call(a, b, out))
def add(l: Launch, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    # bf16 + bf16 is computed exactly in f32 and rounded once, as the NPU's vector add does.
    torch.add(a, b, out=out)


def flash_attn(l: Launch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor,
               out: torch.Tensor) -> None:
    """Causal GQA attention of the chunk over the cached context, f32 softmax: natively where the
    CPU allows, else in torch's fused kernel.

    Query i (absolute position q_start + i) sees keys 0..q_start + i of the [kv_heads, ctx, d] cache.
    """
    s, c, hq, hk, d = l.p("seq"), l.p("ctx"), l.p("q_heads"), l.p("kv_heads"), l.p("head_dim")
    start = int(q_start[0])
    if native_cpu.flash_attention(q.view(s, hq, d), k, v, start, out.view(s, hq, d)):
        return
    qh = q.view(s, hq, d).transpose(0, 1).unsqueeze(0)
    # Only the keys some query sees: a resident cache's capacity (or a longer context) past them
    # would change which of torch's kernels runs, and with it the last bits.
    c = min(c, start + s)
    kh, vh = k[:, :c].unsqueeze(0), v[:, :c].unsqueeze(0)
    if start == 0 and c == s:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=hq != hk)
    else:
        visible = torch.arange(c)[None, :] <= (start + torch.arange(s))[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, enable_gqa=hq != hk)
    out.view(s, hq, d).copy_(o.squeeze(0).transpose(0, 1))


# The masked-score fill of the attention kernels: finite, so max and exp never meet infinities.
MASK_FILL = -1.0e30


def _rows_misfit(l: Launch, at: int) -> IndexError:
    return IndexError(f"{l.name}: {l.p('rows')} rows at position {at} do not fit a {l.p('ctx')}-position cache")


def _position_outside(l: Launch, pos: int) -> IndexError:
    """What a read at `pos` outside the positions `l` may read raises: its window's (the cache's
    whole capacity for a launch without one)."""
    return IndexError(f"{l.name}: position {pos} is outside a {l.param_dict.get('window', l.p('ctx'))}-position window")


# The resident cache's native kernels read the position when they run, through the i32's
# address (the bound call's pointers are fixed; the value changes every token), and refuse one
# outside the cache before writing anything: their call then raises what the torch body does.
def _kv_append_call(l: Launch, k, v, start, k_cache, v_cache) -> Callable[[], None] | None:
    if k_cache.shape != (l.p("kv_heads"), l.p("ctx"), l.p("head_dim")):
        return None
    return native_cpu.kv_append_call(k, v, start, k_cache, v_cache, l.p("rows"),
                                     refused=lambda: _rows_misfit(l, int(start[0])))


def _decode_attn_call(l: Launch, q, k_cache, v_cache, pos, acc, stats) -> Callable[[], None] | None:
    if k_cache.shape != (l.p("kv_heads"), l.p("ctx"), l.p("head_dim")) or q.numel() != l.p("q_heads") * l.p("head_dim"):
        return None
    return native_cpu.decode_attn_call(q, k_cache, v_cache, pos, acc, stats, l.p("chunk"), l.p("splits"),
                                       refused=lambda: _position_outside(l, int(pos[0])))


@_native(_kv_append_call)
def kv_append(l: Launch, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> None:
    """The launch's `rows` token-major K/V rows into the resident head-major cache at positions
    start.., in place: the cache is device state, so what is not written keeps its values."""
    rows, kvh, d = l.p("rows"), l.p("kv_heads"), l.p("head_dim")
    at = int(start[0])
    if not 0 <= at <= l.p("ctx") - rows:
        raise _rows_misfit(l, at)
    k_cache[:, at:at + rows].copy_(k.view(rows, kvh, d).transpose(0, 1))
    v_cache[:, at:at + rows].copy_(v.view(rows, kvh, d).transpose(0, 1))


@_native(_decode_attn_call)
def decode_attn(l: Launch, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                acc: torch.Tensor, stats: torch.Tensor) -> None:
    """One token's partial attention over positions 0..pos of the resident cache, split-K.

    KV head h's split s streams chunks s, s + splits, ... of the live positions with the
    attention kernels' online softmax (f32 scores scaled by 1/sqrt(d), positions past `pos`
    given `MASK_FILL`, probabilities rounded to bf16 and summed as rounded) and leaves its
    unnormalised f32 accumulator in `acc` [kv_heads, splits, group, d] and its running max and
    sum in `stats` [..., group, 2]; `attn_merge` combines them. A split with no chunk leaves
    max = fill, sum = 0, acc = 0, which the merge weighs zero."""
    kvh, d, chunk, splits = l.p("kv_heads"), l.p("head_dim"), l.p("chunk"), l.p("splits")
    group = l.p("q_heads") // kvh
    n_pos = int(pos[0]) + 1
    if not 1 <= n_pos <= l.p("window"):
        raise _position_outside(l, n_pos - 1)
    chunks = -(-n_pos // chunk)
    qh = q.view(kvh, group, d).float()
    scale = 1.0 / d ** 0.5
    for s in range(splits):
        m = torch.full((kvh, group), MASK_FILL)
        total = torch.zeros(kvh, group)
        a = torch.zeros(kvh, group, d)
        for c in range(s, chunks, splits):
            lo, hi = c * chunk, (c + 1) * chunk
            scores = torch.matmul(qh, k_cache[:, lo:hi].float().transpose(1, 2)) * scale
            if hi > n_pos:
                scores[..., n_pos - lo:] = MASK_FILL
            m_new = torch.maximum(m, scores.amax(-1))
            p = torch.exp(scores - m_new[..., None]).to(torch.bfloat16).float()
            corr = torch.exp(m - m_new)
            total = total * corr + p.sum(-1)
            a = a * corr[..., None] + torch.matmul(p, v_cache[:, lo:hi].float())
            m = m_new
        acc[:, s].copy_(a)
        stats[:, s, :, 0].copy_(m)
        stats[:, s, :, 1].copy_(total)


@_native(lambda l, acc, stats, out: native_cpu.attn_merge_call(acc, stats, out, l.p("kv_heads"), l.p("splits"),
                                                              l.p("head_dim")))
def attn_merge(l: Launch, acc: torch.Tensor, stats: torch.Tensor, out: torch.Tensor) -> None:
    """The splits of each KV head's query rows combined: every split's accumulator and sum
    rescaled to the largest running max, their quotient rounded once to bf16."""
    m, total = stats[..., 0], stats[..., 1]
    w = torch.exp(m - m.amax(1, keepdim=True))
    num = (acc * w[..., None]).sum(1)
    den = (total * w).sum(1)
    out.copy_((num / den[..., None]).reshape(-1))


@dataclass(frozen=True)
class AttendStep:
    """A token's `decode_attn` and the `attn_merge` of its partial sums, run as one step on the
    host attention's contract (`attend`); `launches` names them as the group declares them."""

    attn: Launch
    merge: Launch

    @property
    def launches(self) -> tuple[Launch, Launch]:
        return self.attn, self.merge


def attend(step: AttendStep, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
           out: torch.Tensor) -> None:
    """Single-query GQA attention over positions 0..pos, f32 softmax and P·V, rounded once:
    the numbers of the design card's host attention (`kv_cache.decode_attention_cpu`), so the
    fused decode and the card's agree bit for bit on the simulated device."""
    l = step.attn
    kvh, d = l.p("kv_heads"), l.p("head_dim")
    n_pos = int(pos[0]) + 1
    if not 1 <= n_pos <= l.p("window"):
        raise _position_outside(l, n_pos - 1)
    qh = q.view(kvh, l.p("q_heads") // kvh, d).float()
    scores = torch.matmul(qh, k_cache[:, :n_pos].float().transpose(1, 2)).mul_(1.0 / d ** 0.5)
    out.copy_(torch.matmul(torch.softmax(scores, -1), v_cache[:, :n_pos].float()).reshape(-1))


def _attend_native(step: AttendStep, q, k_cache, v_cache, pos, out) -> Callable[[], None] | None:
    return native_cpu.attention_at_call(q, k_cache, v_cache, pos, out,
                                        refused=lambda: _position_outside(step.attn, int(pos[0])))


def _torch_gemvs(jobs) -> None:
    for w, x, y in jobs:
        torch.mv(dense(w), x, out=y)


def _each(steps) -> None:
    for step in steps:
        step()


_GEMV_OPS = ("gemv", "gemv_q4nx")   # independent runs of one of these are batched (`plan`)


def _npu_gemv_q4nx_call(jobs) -> Callable[[], None] | None:
    """The native Q4NX GEMVs where the class's activations are wide (the NPU's closest form),
    else None: the torch body, which is wide on every class."""
    wide = native_cpu.q4nx_activation_bytes(native_cpu.isa()) == q4nx.WIDE
    return _gemv_q4nx_call(jobs) if wide else None


def bind(step: Launch | list[Launch], views: dict[str, torch.Tensor],
         npu_numerics: bool = False) -> Callable[[], None]:
    """A plan step fixed to one BO set's views: its native kernel with pointers and sizes bound
    where the op has one (the same kernel a call of the op would pick), else the op's torch body.
    A batch of independent GEMVs (see `plan`) becomes one native dispatch.

    `npu_numerics`: where a class's native kernel takes a cheaper contract than the NPU's (Q4NX
    on `avx2` and `avx512`: one-byte activations, prefill on decode's integer contract), bind the NPU's form
    instead (`_NPU_NATIVE`, or the torch body), so the interpreted MLIR can be held to the
    numbers the NPU computes on every class.

    Ops are looked up in `OPS` when binding, so an op replaced there is what runs.
    """
    if isinstance(step, AttendStep):
        args = [views[a] for a in step.attn.reads] + [views[step.merge.writes[0]]]
        return _attend_native(step, *args) or partial(attend, step, *args)
    if isinstance(step, list):
        jobs = [(views[l.reads[1]], views[l.reads[0]], views[l.writes[0]]) for l in step]
        if step[0].op == "gemv_q4nx":
            own = npu_numerics and OPS["gemv_q4nx"] is gemv_q4nx
            return ((_npu_gemv_q4nx_call if own else _gemv_q4nx_call)(jobs)
                    or partial(_each, [_bind_one(l, views, npu_numerics) for l in step]))
        return _gemv_call(jobs) or partial(_torch_gemvs, jobs)
    return _bind_one(step, views, npu_numerics)


def _bind_one(step: Launch, views: dict[str, torch.Tensor], npu_numerics: bool) -> Callable[[], None]:
    op = OPS[step.op]
    args = tuple(views[a] for a in step.args)
    native = getattr(op, "native", None)
    if npu_numerics:
        native = _NPU_NATIVE.get(op, native)
    # A binder that declines now declines on every call (same views, same library): the body.
    return (native(step, *args) if native else None) or partial(getattr(op, "__wrapped__", op), step, *args)


def plan(launches: tuple[Launch, ...], host_attention: bool = False) -> list[Launch | list[Launch] | AttendStep]:
    """Launch order for the simulator: runs of mutually independent GEMVs of one op become one batch.

    Same launches, same results: a batch only groups GEMVs whose inputs none of them writes,
    so their order never mattered (Q/K/V of a layer, gate and up, the LM-head partitions).
    With `host_attention`, a `decode_attn` and the `attn_merge` of its partials become one
    `AttendStep` (the host attention's numbers; nothing else reads the partials).
    """
    steps: list[Launch | list[Launch] | AttendStep] = []
    batch: list[Launch] = []
    written: set[str] = set()
    pending: Launch | None = None     # a decode_attn waiting for its merge
    for l in launches:
        if host_attention and l.op == "decode_attn":
            pending = l
            continue
        if pending is not None:
            if l.op != "attn_merge" or tuple(l.reads) != tuple(pending.writes):
                raise ValueError(f"{pending.name}: a decode_attn is followed by the attn_merge of its partials, "
                                 f"not {l.name}")
            l, pending = AttendStep(pending, l), None
        if isinstance(l, AttendStep):
            if batch:
                steps.append(batch)
                batch, written = [], set()
            steps.append(l)
            continue
        if l.op in _GEMV_OPS and batch and l.op == batch[0].op and not (set(l.reads) & written):
            batch.append(l)
            written |= set(l.writes)
            continue
        if batch:
            steps.append(batch)
            batch, written = [], set()
        if l.op in _GEMV_OPS:
            batch, written = [l], set(l.writes)
        else:
            steps.append(l)
    if batch:
        steps.append(batch)
    return steps


OPS = {
    "rmsnorm": rmsnorm,
    "gemm": gemm,
    "gemv": gemv,
    "gemm_q4nx": gemm_q4nx,
    "gemv_q4nx": gemv_q4nx,
    "rope": rope,
    "swiglu": swiglu,
    "add": add,
    "flash_attn": flash_attn,
    "kv_append": kv_append,
    "decode_attn": decode_attn,
    "attn_merge": attn_merge,
}

# The binders that keep the NPU's numbers where an op's own binder takes a class's cheaper
# contract (`bind`'s `npu_numerics`), keyed by the op itself: an op replaced in `OPS` has none.
_NPU_NATIVE = {
    gemm_q4nx: partial(_gemm_q4nx_call, integer=False),     # the dequantizing GEMM, as the NPU's prefill
    gemv_q4nx: lambda l, x, w, out: _npu_gemv_q4nx_call([(w, x, out)]),
}
