"""The model's math as short plain-torch functions: the contract every device is tested against.

Written independently of the simulator's ops and the native kernels: f32 math from bf16
operands, and a rounding to bf16 exactly where a launch stores its result, plus the two inside
a launch: RMSNorm's normalised row (where HF rounds it) and prefill attention's probabilities
(which every flash kernel hands to its P·V product in bf16). The simulated device (torch bodies
and native kernels of every ISA class), the native kernels alone, the interpreter and the NPU
kernels' host builds are each compared with these within a stated number of bf16 ulps
(`assert_within_ulps`, with the shared bounds below it).

4-bit weights enter as a projection (`llama_base.q4nx` holds the format and its two contract
functions): prefill multiplies the dequantized bf16 weights (`lin_q4nx`), decode folds the
dequantization into its sums (`gemv_q4nx`, at a CPU class's activation width:
`native_build.Q4NX_NARROW_ACTIVATIONS`), and so does prefill on the CPU classes that run it on
byte products (`native_build.INTEGER_Q4NX_GEMM`). The layer functions take the projection to use.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch

from llama_base import q4nx

bf = torch.bfloat16


# --- one launch each ----------------------------------------------------------------------

def rms(x, w, eps):
    """RMSNorm with HF's two roundings: the normalised row to bf16, then its product with the weight."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(bf)
    return (normed.float() * w.float()).to(bf)


def lin(x, w):
    """x Wᵀ for x [..., K], W [N, K]: a GEMM's rows or a GEMV's one row (decode, the LM head).
    bf16 products are exact in f32; summed in f32, rounded once."""
    return (x.float() @ w.float().t()).to(bf)


def lin_q4nx(x, buf):
    """Prefill on Q4NX weights: each weight dequantized to bf16 (one rounding), then `lin`.
    K is x's width; N follows from the byte count."""
    k = x.shape[-1]
    return lin(x, q4nx.dequantize(buf, _q4nx_rows(buf, k), k))


def gemv_q4nx(x, buf, act_bytes=q4nx.WIDE):
    """Decode on Q4NX weights: `q4nx.gemv_reference`'s f32 sums (the dequantization folded in,
    no weight rounded) with activations `act_bytes` wide, rounded once. x [K], or rows [..., K]
    each taken as its own GEMV."""
    k = x.shape[-1]
    n = _q4nx_rows(buf, k)
    rows = [q4nx.gemv_reference(buf, r, n, k, act_bytes) for r in x.reshape(-1, k)]
    return torch.stack(rows).reshape(*x.shape[:-1], n).to(bf)


def _q4nx_rows(buf, k):
    return buf.numel() * q4nx.ROWS // (k * q4nx.BYTES_PER_COL)


def rope(x, lut, heads):
    """Half-split RoPE (HF `rotate_half`) with each position's cos | sin table row: the products
    are exact in f32, each sum rounds in f32, then once to bf16."""
    d = lut.shape[-1]
    h = d // 2
    table = lut.float().reshape(-1, 1, d)
    c, s = table[..., :h], table[..., h:]
    xf = x.float().reshape(table.shape[0], heads, d)
    a, b = xf[..., :h], xf[..., h:]
    return torch.cat([a * c - b * s, b * c + a * s], -1).reshape(x.shape).to(bf)


def add(a, b):
    """The residual add: in f32, rounded once."""
    return (a.float() + b.float()).to(bf)


def swiglu(gate, up):
    """silu(gate) · up in f32, rounded once."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(bf)


def attention(q, k, v, n_heads, n_kv_heads, q_start=0):
    """Causal GQA attention, q [n, Hq·d] at positions q_start.., k/v [T, Hkv·d]: f32 scores,
    softmax and P·V, rounded once. Decode's host attention (one query) computes this."""
    p = torch.softmax(_scores(q, k, n_heads, n_kv_heads, q_start), -1)
    return _token_major(p @ _per_query_head(v, n_heads, n_kv_heads)).to(bf)


def flash_attention(q, k, v, n_heads, n_kv_heads, q_start=0):
    """Prefill's attention: as `attention`, but the probabilities exp(s - row max) enter P·V
    rounded to bf16; their sum, the divisor, stays f32. A flash kernel rounds them against its
    running maximum instead, so its P may differ from these by a rounding (`FLASH_ULPS`)."""
    s = _scores(q, k, n_heads, n_kv_heads, q_start)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    o = e.to(bf).float() @ _per_query_head(v, n_heads, n_kv_heads)
    return _token_major(o / e.sum(-1, keepdim=True)).to(bf)


def _scores(q, k, n_heads, n_kv_heads, q_start):
    """f32 scores [Hq, n, T]; query row i (position q_start + i) sees keys 0..q_start + i."""
    n, t = q.shape[0], k.shape[0]
    d = q.shape[1] // n_heads
    qh = q.float().view(n, n_heads, d).transpose(0, 1)
    s = qh @ _per_query_head(k, n_heads, n_kv_heads).transpose(1, 2) / math.sqrt(d)
    future = torch.arange(t)[None, :] > torch.arange(q_start, q_start + n)[:, None]
    return s.masked_fill(future, float("-inf"))


def _per_query_head(t, n_heads, n_kv_heads):
    """Token-major rows [T, Hkv·d] as f32 [Hq, T, d], each KV head repeated for its query group."""
    d = t.shape[1] // n_kv_heads
    return t.float().view(t.shape[0], n_kv_heads, d).transpose(0, 1).repeat_interleave(n_heads // n_kv_heads, 0)


def _token_major(o):
    return o.transpose(0, 1).reshape(o.shape[1], -1)


# --- the groups: every slot a launch stores, by the group's slot names ---------------------

def rms_gemms_rope(cfg, lw, x, lut, proj=lin):
    """The attention half's projections: prefill's rows, or decode's one row."""
    normed = rms(x, lw.attn_norm, cfg.rms_norm_eps)
    q_raw, k_raw = proj(normed, lw.wq), proj(normed, lw.wk)
    return {"normed": normed, "q_raw": q_raw, "k_raw": k_raw, "v": proj(normed, lw.wv),
            "q": rope(q_raw, lut, cfg.num_attention_heads), "k": rope(k_raw, lut, cfg.num_key_value_heads)}


def o_ffn(cfg, lw, attn, x, proj=lin):
    """O projection, residual, RMSNorm, SwiGLU MLP, residual."""
    o = proj(attn, lw.wo)
    h1 = add(x, o)
    normed = rms(h1, lw.ffn_norm, cfg.rms_norm_eps)
    gate, up = proj(normed, lw.w_gate), proj(normed, lw.w_up)
    act = swiglu(gate, up)
    down = proj(act, lw.w_down)
    return {"o": o, "h1": h1, "normed": normed, "gate": gate, "up": up, "act": act, "down": down,
            "out": add(h1, down)}


def logits(normed, head, proj=lin):
    """The LM head on the final normed row: bf16 logits, as the device stores them (its
    vocabulary partitions are row ranges of this one product)."""
    return proj(normed, head)


def group_outputs(cfg, group, data, integer_prefill: bool = False, act_bytes: int = q4nx.WIDE):
    """Every slot a kernel group's launches store, from its input and weight slots (`data`, by
    slot name): the functions above, chosen by the group's kind and weight format.
    `integer_prefill`: Q4NX prefill on decode's contract, row by row, as the CPU classes in
    `native_build.INTEGER_Q4NX_GEMM` compute it, rather than on the dequantized weights.
    `act_bytes`: decode's activation width (`native_cpu.q4nx_activation_bytes` of a class)."""
    lw = SimpleNamespace(**data)
    decode_form = group.seq_len == 1 or integer_prefill
    decode = lambda x, buf: gemv_q4nx(x, buf, act_bytes)     # noqa: E731
    quantized = decode if decode_form else lin_q4nx
    # Each weight by its own format: a quantized group may hold some in bf16 (`KernelGroup.wide`).
    proj = lambda x, w: quantized(x, w) if w.dtype == torch.uint8 else lin(x, w)    # noqa: E731
    if group.kind in ("rms_gemms_rope", "rms_gemv_rope"):
        return rms_gemms_rope(cfg, lw, data["x"], data["rope_lut"], proj)
    if group.kind in ("o_ffn", "o_gemv_ffn"):
        return o_ffn(cfg, lw, data["attn"], data["x_res"], proj)
    if group.kind == "lm_head_gemv":
        return {s.name: logits(data["x"], data["w_" + s.name.removeprefix("logits_")], proj)
                for s in group.slots if s.name.startswith("logits_")}
    if group.kind == "flash_attn":
        return {"attn": flash_attention(*_attention_args(cfg, data))}
    raise ValueError(f"no reference for group kind {group.kind!r}")


def _attention_args(cfg, data):
    """flash_attention's arguments from the group's slots ([Hkv, ctx, d] caches made token-major)."""
    tok = lambda t: t.transpose(0, 1).reshape(t.shape[1], -1)     # noqa: E731
    return (data["q"], tok(data["k_cache"]), tok(data["v_cache"]), cfg.num_attention_heads,
            cfg.num_key_value_heads, int(data["q_start"][0]))


# --- comparing with the reference ---------------------------------------------------------

def ulps(got, want) -> torch.Tensor:
    """Distance in bf16 steps between two bf16 tensors (torch, or numpy ml_dtypes bf16), as f32.

    Each bit pattern is mapped onto one line of representable values (sign-magnitude to signed),
    so +0 and -0 are 0 apart, steps across zero count, and ±inf is one step past the largest
    finite value. NaN: 0 where both are NaN (any payload), inf where only one is.
    """
    a, b = _bits(got).int(), _bits(want).int()
    line = lambda i: torch.where(i < 0, -(i & 0x7FFF), i)      # noqa: E731
    nan_a, nan_b = (a & 0x7FFF) > 0x7F80, (b & 0x7FFF) > 0x7F80
    d = (line(a) - line(b)).abs().float()
    return torch.where(nan_a | nan_b, torch.where(nan_a & nan_b, 0.0, math.inf), d)


def assert_within_ulps(got, want, max_ulps: float, max_fraction: float | None = None, *,
                       floor=None, what: str = "") -> None:
    """Every element of `got` within `max_ulps` bf16 steps of `want`; with `max_fraction`, also
    at most that fraction of the elements off at all (one element at least, when it is not 0:
    on a 32-value output a fraction would otherwise forbid the one ulp it allows).

    `floor` (a number, or a tensor broadcast against `want`): where |want| is below it, the
    difference is counted in steps of the floor's size. A sum that cancels to near zero keeps
    the error of its terms' size, many steps of its own small value; the floor says how large
    those terms were (`sum_floor`, or what the test states).
    """
    d, w, g = ulps(got, want), _as_float(want), _as_float(got)
    if floor is not None:
        fl = torch.as_tensor(floor, dtype=torch.float32).expand_as(w)
        step = torch.ldexp(torch.ones_like(fl), torch.frexp(fl).exponent - 8)    # bf16's step at the floor
        d = torch.where(w.abs() < fl, (g - w).abs() / step, d).nan_to_num(math.inf)   # a NaN got: inf
    if not d.numel():
        return
    worst, n_off = int(d.argmax()), int((d > 0).sum())
    off = n_off / d.numel()
    detail = (f"worst {float(d.view(-1)[worst]):g} ulps at flat index {worst} (got {float(g.view(-1)[worst]):g}, "
              f"want {float(w.view(-1)[worst]):g}); {off:.3%} of {d.numel()} elements differ")
    where = f"{what}: " if what else ""
    assert float(d.max()) <= max_ulps, f"{where}over {max_ulps:g} ulps: {detail}"
    if max_fraction is not None:
        allowed = max(max_fraction * d.numel(), 1 if max_fraction > 0 else 0)
        assert n_off <= allowed, f"{where}over {max_fraction:.3%} differ: {detail}"


def _bits(t) -> torch.Tensor:
    """bf16 bit patterns (int16) of a torch bf16 tensor or a numpy array of ml_dtypes bf16."""
    if isinstance(t, torch.Tensor):
        if t.dtype != bf:
            raise TypeError(f"bf16 ulps are counted between bf16 tensors, not {t.dtype}")
        return t.contiguous().view(torch.int16)
    a = np.ascontiguousarray(t)
    if a.dtype.itemsize != 2 or a.dtype.kind in "iuf":
        raise TypeError(f"bf16 ulps are counted between bf16 arrays, not {a.dtype}")
    return torch.from_numpy(a.view(np.int16).copy())


def _as_float(t) -> torch.Tensor:
    return _bits(t).view(bf).float()


# The bounds the device tests share, each with its reason.

REORDERED = 0.01
"""f32 sums in another order than the reference's (core tiles, K steps, SIMD lanes): one ulp
apart where the two sums straddle a bf16 rounding boundary, which is rare (measured: under
0.05 % of a GEMM's outputs). `max_ulps` 1 and at most this fraction; a 1 % scale moves all."""

CHAINED = 0.03
"""A group's launches feed each other: a value one ulp apart in one launch's output is an input
of the next, which then differs more often than a launch alone (measured on the interpreter: up
to 1.03 % of o_ffn's down projection at bucket 64, behind 0.74 % of its SwiGLU's)."""

CANCELLED = 2.0 ** -8
"""A sum that cancels below this fraction of its terms' magnitude is measured at that size
(`sum_floor`): reordering moves it by an f32 rounding of the terms, not of the result."""

FLASH_ULPS, FLASH_FRACTION = 2, 0.3
"""Prefill attention: each flash kernel rounds its probabilities against its own running
maximum (and some sum the rounded ones), so its bf16 P differs from `flash_attention`'s by a
rounding (up to 2^-9 of a weight) here and there. Measured at the size of the terms Σ p |v|
(`attention_floor`): at most 2 ulps apart (torch's fused kernel; the native and the NPU kernels
1), in up to 24 % of the elements (the NPU kernel's 16-position tiles at head dim 128). A 1 %
scale moves nearly all of them."""


def sum_floor(x, w):
    """`CANCELLED` of the magnitude of each output's terms: |x| |W|ᵀ, for `floor=`."""
    return CANCELLED * (x.float().abs() @ w.float().abs().t())


def attention_floor(q, k, v, n_heads, n_kv_heads, q_start=0):
    """The magnitude of each attention output's terms, Σ p |v| (for `floor=`): the probabilities'
    rounding is relative to it, not to the output, which may cancel to near zero."""
    return flash_attention(q, k, v.abs(), n_heads, n_kv_heads, q_start).float()


def assert_group_matches(cfg, group, data, got, max_fraction: float = CHAINED,
                         integer_prefill: bool = False, act_bytes: int = q4nx.WIDE) -> None:
    """Every slot in `got` (outputs, and any intermediates the caller read back) against
    `group_outputs`.

    A device's intermediate may round one ulp apart (`REORDERED`, `CHAINED`); a later launch that
    adds it to terms of other sizes (a residual, RoPE's rotation, a GEMM) carries that ulp at the
    size of its largest term, which the row's largest |value| stands for: so each value is held
    to one ulp at that size (`floor`), and to differ at all in at most `max_fraction` of the
    elements. Attention's outputs are held to the flash bound at their terms' size instead.
    """
    want = group_outputs(cfg, group, data, integer_prefill, act_bytes)
    for name, g in got.items():
        w = want[name]
        if group.kind == "flash_attn":
            bound, floor = (FLASH_ULPS, FLASH_FRACTION), attention_floor(*_attention_args(cfg, data))
        else:
            bound, floor = (1, max_fraction), w.float().abs().amax(-1, keepdim=True)
        assert_within_ulps(g.reshape(w.shape), w, *bound, floor=floor, what=f"{group.name} {name}")
