"""The external C++ kernels: their host builds (the scalar paths the interpreter runs) against
`reference`, their `extern "C"` signatures against `externs.py`, and the object build's stamps
and Peano probe."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from kernel_builder import backend_presets as presets
from kernel_builder import externs
from kernel_builder.external_kernels import (
    KERNELS_DIR,
    PEANO_FLAGS,
    PEANO_TARGET,
    Toolchain,
    ToolchainNotFound,
    build_objects,
    define_flags,
    externs_for_groups,
    find_peano,
    peano_toolchain,
)
from kernel_builder.groups import all_groups, build_group, prefill_buckets
from llama_base import q4nx
from llama_base.config import LlamaConfig
from verify import reference as ref
from llama_base.rope import generate_rope_lut
from npu_runtime.interp.host_kernels import ELEMENT_TYPES, HOST_FLAGS, ArgType, HostKernels, host_toolchain

BF16 = np.dtype(ml_dtypes.bfloat16)
LLAMA = LlamaConfig()
SMOLLM2 = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
                      rope_scaling=None, max_position_embeddings=8192)
ROPE_POSITIONS = (0, 1, 777, 8191)
ATTN_SEQ = 128
ATTN_KV_HEADS, ATTN_Q_HEADS = 2, 4
ATTN_HEAD_DIMS = (64, 128)


def _launch(group, name):
    return next(l for l in group.launches if l.name == name)


def _gemv_kernels():
    g = build_group("o_gemv_ffn", LLAMA)
    return [externs.externs_for_launch(_launch(g, n))[0] for n in ("gate_proj", "down_proj")]


def _q4nx_kernels():
    """The fused GEMVs of Llama (full blocks) and SmolLM2 (K = 576: a 64-wide last block), the
    prefill dequantization of the presets' tile, and one of a tile wider than a block."""
    gemvs = [externs.externs_for_launch(_launch(build_group("o_gemv_ffn", cfg, quant=q4nx.NAME), "o_proj"))[0]
             for cfg in (LLAMA, SMOLLM2)]
    prefill = _launch(build_group("o_ffn", LLAMA, presets.PREFILL_BUCKETS[0], quant=q4nx.NAME), "o_proj")
    return gemvs, [externs.externs_for_launch(prefill)[0], externs.dequant_q4nx(64, q4nx.COLS + 64)]


def _swiglu_kernel():
    return externs.externs_for_launch(_launch(build_group("o_gemv_ffn", LLAMA), "swiglu"))[0]


def _attention_kernels(head_dim):
    t = presets.attention_tiling(ATTN_SEQ, head_dim)["tile_q"]
    return {dict(k.defines)["ATTN_ONLY"]: k for k in externs.attention(head_dim, t)}, t


# Decode attention at the tiny model's shape: 2 KV heads of 2 query heads, 4 splits of
# 64-position chunks.
DEC_KV_HEADS, DEC_GROUP, DEC_DIM, DEC_CHUNK, DEC_SPLITS, DEC_CTX = 2, 2, 64, 64, 4, 512


def _decode_kernels():
    prims = {dict(k.defines)["ATTN_ONLY"]: k for k in externs.decode_attention(DEC_DIM, DEC_GROUP, DEC_CHUNK)}
    return prims, externs.attention_merge(DEC_DIM, DEC_GROUP, DEC_SPLITS)


@pytest.fixture(scope="session")
def hk(tmp_path_factory):
    kernels = [externs.rope(LLAMA.head_dim), _swiglu_kernel(), *_gemv_kernels(), *sum(_q4nx_kernels(), [])]
    for d in ATTN_HEAD_DIMS:
        kernels += _attention_kernels(d)[0].values()
    prims, merge = _decode_kernels()
    kernels += [*prims.values(), merge]
    return HostKernels(kernels, tmp_path_factory.mktemp("host_kernels"))


def rand_bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(BF16)


def torch_bf16(a: np.ndarray) -> torch.Tensor:
    """A numpy bf16 array as the torch tensor `reference` takes (same bits)."""
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)


# --- RoPE ------------------------------------------------------------------------------

def test_rope_matches_hf_rotate_half_at_scaled_lut_positions(hk):
    lut = generate_rope_lut(LLAMA, max(ROPE_POSITIONS) + 1).float().numpy().astype(BF16)
    sym, d = externs.rope(LLAMA.head_dim).symbol, LLAMA.head_dim
    rng = np.random.default_rng(0)
    for pos in ROPE_POSITIONS:
        x = rand_bf16(rng, (LLAMA.num_attention_heads, d))
        y = np.empty_like(x)
        for head in range(x.shape[0]):
            hk(sym, x[head], lut[pos], y[head])
        # bf16 x bf16 products are exact in f32, so the one f32 add rounds as the reference's does.
        want = ref.rope(torch_bf16(x), torch_bf16(lut[pos]), x.shape[0])
        ref.assert_within_ulps(y, want, 0, what=f"position {pos}")
        if pos == 0:
            np.testing.assert_array_equal(y.view(np.uint16), x.view(np.uint16))


# --- SwiGLU ----------------------------------------------------------------------------

def test_silu_and_mul_over_a_full_ffn_row_in_tiles(hk):
    k = _swiglu_kernel()
    tile, f = dict(k.defines)["SWIGLU_TILE"], LLAMA.intermediate_size
    assert f // tile > 1 and f % tile == 0
    rng = np.random.default_rng(1)
    gate, up = rand_bf16(rng, f, 3.0), rand_bf16(rng, f)
    gate[:4] = np.array([-100.0, 100.0, 0.0, -0.0], dtype=BF16)  # saturated and zero activations
    out = np.empty(f, BF16)
    for t0 in range(0, f, tile):
        hk(k.symbol, gate[t0:t0 + tile], up[t0:t0 + tile], out[t0:t0 + tile])
    # The kernel's own exp: an ulp off the reference's f32 silu, rarely (`REORDERED`).
    assert np.isfinite(out.astype(np.float32)).all()
    ref.assert_within_ulps(out, ref.swiglu(torch_bf16(gate), torch_bf16(up)), 1, ref.REORDERED)


# --- GEMV ------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", _gemv_kernels(), ids=lambda k: k.symbol)
def test_gemv_tiles_match_the_reference(hk, kernel):
    """Tiles of rows as the builder streams them (whole K, or K tiles into f32 partial sums),
    against `reference.lin`: f32 sums in another order (`REORDERED`)."""
    defs = dict(kernel.defines)
    tm, k = defs["GEMV_TILE_M"], defs["GEMV_K"]
    rows = 16 * tm
    rng = np.random.default_rng(k)
    w, x = rand_bf16(rng, (rows, k), 0.02), rand_bf16(rng, k)
    y = np.empty(rows, BF16)
    tk = defs.get("GEMV_TILE_K")
    for r0 in range(0, rows, tm):
        if tk is None:
            hk(kernel.symbol, w[r0:r0 + tm], x, y[r0:r0 + tm])
            continue
        acc = np.zeros(tm, np.float32)                 # the K-split form: f32 sums across K tiles
        for c0 in range(0, k, tk):
            hk(kernel.symbol, np.ascontiguousarray(w[r0:r0 + tm, c0:c0 + tk]), x, acc, c0)
        y[r0:r0 + tm] = acc.astype(BF16)
    wt, xt = torch_bf16(w), torch_bf16(x)
    ref.assert_within_ulps(y, ref.lin(xt, wt), 1, ref.REORDERED, floor=ref.sum_floor(xt, wt))


# --- Q4NX ------------------------------------------------------------------------------

def random_q4nx(rng, n, k):
    """Q4NX bytes of random 4-bit values with scales and mins of both signs over several octaves."""
    q = torch.from_numpy(rng.integers(0, q4nx.LEVELS + 1, (n, k), dtype=np.int64))
    sc = torch.from_numpy(rng.standard_normal((n, k // q4nx.GROUP)) * 2.0 ** rng.integers(-12, -2, (n, 1)))
    mn = torch.from_numpy(rng.standard_normal((n, k // q4nx.GROUP)) * 2.0 ** rng.integers(-9, -1, (n, 1)))
    return q4nx.pack(q, sc, mn)


@pytest.mark.parametrize("kernel", _q4nx_kernels()[0], ids=lambda k: k.symbol)
def test_fused_q4nx_gemv_matches_the_decode_contract(hk, kernel):
    """Blocks of row-blocks through the kernel as the MLIR builder streams them, against
    `q4nx.gemv_reference` within the documented difference: the fixed point's rounding of x
    (under 2^-15 of its group's largest |x|, times the group's |scale| * q) plus f32 rounding."""
    defs = dict(kernel.defines)
    tk, k = defs["GEMV_Q4NX_TILE_K"], defs["GEMV_Q4NX_K"]
    n = 3 * q4nx.ROWS
    rng = np.random.default_rng(k)
    buf = random_q4nx(rng, n, k)
    x = rand_bf16(rng, k)
    x[: q4nx.GROUP] *= np.asarray(2.0 ** -np.arange(q4nx.GROUP), dtype=np.float32).astype(BF16)  # spread group
    layout = q4nx.Layout(n, k)
    blocks = layout.col_blocks()
    assert all(c <= tk for _, c in blocks) and (k != SMOLLM2.hidden_size or blocks[-1][1] < tk)
    raw = buf.numpy()
    y = np.zeros(n, np.float32)
    for rb in range(layout.row_blocks):
        acc = np.zeros(q4nx.ROWS, np.float32)
        for c0, c in blocks:
            blk = np.zeros(q4nx.BYTES_PER_COL * tk, np.uint8)
            at = layout.block_offset(rb, c0)
            blk[: q4nx.BYTES_PER_COL * c] = raw[at: at + q4nx.BYTES_PER_COL * c]
            hk(kernel.symbol, blk, x, acc, c0, c)
        y[rb * q4nx.ROWS:(rb + 1) * q4nx.ROWS] = acc
    xt = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    want = q4nx.gemv_reference(buf, xt, n, k).numpy()
    qv, sc, mn = (t.double().numpy() for t in q4nx.unpack(buf, n, k))
    xf = x.astype(np.float64).reshape(-1, q4nx.GROUP)
    top = np.abs(xf).max(1)
    s_q = (qv.reshape(n, -1, q4nx.GROUP).sum(2) * np.abs(sc))                        # [n, groups]
    terms = np.abs(qv * np.repeat(sc, q4nx.GROUP, 1)) + np.abs(np.repeat(mn, q4nx.GROUP, 1))
    bound = 2.0 ** -15 * (s_q * top).sum(1) + 2.0 ** -18 * (terms @ np.abs(x.astype(np.float64)))
    assert (np.abs(y - want) <= bound).all(), np.abs(y - want).max()
    exact = (qv * np.repeat(sc, q4nx.GROUP, 1) + np.repeat(mn, q4nx.GROUP, 1)) @ x.astype(np.float64)
    assert (np.abs(y - exact) <= 2.0 ** -18 * (terms @ np.abs(x.astype(np.float64)))).all()   # f32 sums only


@pytest.mark.parametrize("kernel", _q4nx_kernels()[1], ids=lambda k: k.symbol)
def test_q4nx_dequantization_is_bit_exact(hk, kernel):
    defs = dict(kernel.defines)
    n, k = defs["DEQUANT_Q4NX_ROWS"], defs["DEQUANT_Q4NX_COLS"]
    rng = np.random.default_rng(n + k)
    buf = random_q4nx(rng, n, k)
    out = np.empty((n, k), BF16)
    hk(kernel.symbol, buf.numpy(), out)
    want = q4nx.dequantize(buf, n, k).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(out.view(np.uint16), want)


def test_the_hidden_and_ffn_gemv_variants_are_distinct_symbols():
    ks = {dict(k.defines)["GEMV_K"]: k.symbol for k in _gemv_kernels()}
    assert set(ks) == {LLAMA.hidden_size, LLAMA.intermediate_size}
    assert len(set(ks.values())) == 2


# --- attention -------------------------------------------------------------------------

def run_flash(hk, prims, tile, q, k, v, kv_order=None):
    """One head through the primitives; `kv_order(qt)` overrides the key tiles a query tile visits."""
    seq, d = q.shape
    out = np.empty_like(q)
    for qt in range(seq // tile):
        rows = slice(qt * tile, (qt + 1) * tile)
        m, l = np.empty(tile, np.float32), np.empty(tile, np.float32)
        acc = np.empty((tile, d), np.float32)
        hk(prims["init"].symbol, m, l, acc)
        for kt in (kv_order(qt) if kv_order else range(qt + 1)):
            keys = slice(kt * tile, (kt + 1) * tile)
            s = np.empty((tile, tile), np.float32)
            hk(prims["qk"].symbol, q[rows], k[keys], s)
            if kt >= qt:
                hk(prims["mask"].symbol, s, qt * tile, kt * tile)
            p, corr = np.empty((tile, tile), BF16), np.empty(tile, np.float32)
            hk(prims["softmax"].symbol, s, m, l, p, corr)
            hk(prims["pv"].symbol, p, v[keys], corr, acc)
        hk(prims["finalize"].symbol, acc, l, out[rows])
    return out


def blocked_reference(q, k, v, tile):
    """The primitives' algorithm in numpy f32, with the probabilities rounded to bf16 as the kernel does."""
    seq, d = q.shape
    qf, kf, vf = (a.astype(np.float32) for a in (q, k, v))
    out = np.empty((seq, d), np.float32)
    pos = np.arange(seq)
    for qt in range(seq // tile):
        r = slice(qt * tile, (qt + 1) * tile)
        m = np.full(tile, -np.inf, np.float32)
        l, acc = np.zeros(tile, np.float32), np.zeros((tile, d), np.float32)
        for kt in range(qt + 1):
            c = slice(kt * tile, (kt + 1) * tile)
            s = (qf[r] @ kf[c].T) * np.float32(1 / math.sqrt(d))
            s = np.where(pos[c][None, :] > pos[r][:, None], -np.inf, s)
            m_new = np.maximum(m, s.max(axis=1))
            p = np.exp(s - m_new[:, None]).astype(BF16).astype(np.float32)
            corr = np.exp(m - m_new)
            l = l * corr + p.sum(axis=1)
            acc = acc * corr[:, None] + p @ vf[c]
            m = m_new
        out[r] = acc / l[:, None]
    return out.astype(BF16)


@pytest.mark.parametrize("head_dim", ATTN_HEAD_DIMS)
def test_flash_attention_primitives_match_causal_gqa_softmax_attention(hk, head_dim):
    """One head at a time through the primitives as the builder calls them, against
    `reference.flash_attention` (the flash bound), and against the primitives' own blocked
    algorithm (P rounded against the running maximum, the rounded P summed), which leaves only
    f32 summation order."""
    prims, tile = _attention_kernels(head_dim)
    assert ATTN_SEQ // tile > 1
    rng = np.random.default_rng(head_dim)
    q = rand_bf16(rng, (ATTN_Q_HEADS, ATTN_SEQ, head_dim))
    k = rand_bf16(rng, (ATTN_KV_HEADS, ATTN_SEQ, head_dim))
    v = rand_bf16(rng, (ATTN_KV_HEADS, ATTN_SEQ, head_dim))
    group = ATTN_Q_HEADS // ATTN_KV_HEADS
    got = np.stack([run_flash(hk, prims, tile, q[h], k[h // group], v[h // group]) for h in range(ATTN_Q_HEADS)])

    heads = [[torch_bf16(t) for t in (q[h], k[h // group], v[h // group])] for h in range(ATTN_Q_HEADS)]
    want = torch.stack([ref.flash_attention(*qkv, 1, 1) for qkv in heads])
    floor = torch.stack([ref.attention_floor(*qkv, 1, 1) for qkv in heads])
    ref.assert_within_ulps(got, want, ref.FLASH_ULPS, ref.FLASH_FRACTION, floor=floor)
    # The primitives' own tiling and rounding, in numpy: what is left is f32 summation order.
    blocked = np.stack([blocked_reference(q[h], k[h // group], v[h // group], tile) for h in range(ATTN_Q_HEADS)])
    ref.assert_within_ulps(got, blocked, 1, ref.REORDERED, floor=ref.CANCELLED * floor)


def test_a_wholly_masked_key_tile_is_erased_by_the_next_real_one(hk):
    prims, tile = _attention_kernels(ATTN_HEAD_DIMS[0])
    rng = np.random.default_rng(7)
    q, k, v = (rand_bf16(rng, (2 * tile, ATTN_HEAD_DIMS[0])) for _ in range(3))
    normal = run_flash(hk, prims, tile, q, k, v)
    # Query tile 0 first visits key tile 1, every key of which lies in its future.
    future_first = run_flash(hk, prims, tile, q, k, v, kv_order=lambda qt: [1, 0] if qt == 0 else range(qt + 1))
    np.testing.assert_array_equal(future_first.view(np.uint16), normal.view(np.uint16))


def test_mask_uses_absolute_positions(hk):
    prims, tile = _attention_kernels(ATTN_HEAD_DIMS[0])
    rng = np.random.default_rng(3)
    q_pos0, k_pos0 = 100, 80                      # a later chunk against cached keys
    s = rng.standard_normal((tile, tile), dtype=np.float32)
    before = s.copy()
    hk(prims["mask"].symbol, s, q_pos0, k_pos0)
    future = (k_pos0 + np.arange(tile))[None, :] > (q_pos0 + np.arange(tile))[:, None]
    assert future.any() and (~future).any()
    np.testing.assert_array_equal(s[~future], before[~future])
    assert (s[future] < -1e29).all()


def test_decode_mask_puts_every_row_at_the_token_s_position(hk):
    """Row step 0: the group's query heads are one token, so the columns past its position
    are masked in every row alike, those up to it in none."""
    prims, _ = _decode_kernels()
    rng = np.random.default_rng(4)
    pos, k_pos0 = 150, 128
    s = rng.standard_normal((DEC_GROUP, DEC_CHUNK), dtype=np.float32)
    before = s.copy()
    hk(prims["mask"].symbol, s, pos, k_pos0)
    future = np.broadcast_to(k_pos0 + np.arange(DEC_CHUNK) > pos, s.shape)
    np.testing.assert_array_equal(s[~future], before[~future])
    assert (s[future] < -1e29).all() and future[0].sum() == k_pos0 + DEC_CHUNK - 1 - pos


def _decode_launches():
    from llama_base.group_contract import Launch

    common = (("head_dim", DEC_DIM), ("kv_heads", DEC_KV_HEADS), ("q_heads", DEC_KV_HEADS * DEC_GROUP),
              ("splits", DEC_SPLITS))
    attn = Launch("attn", "decode_attn", (), (), common + (("chunk", DEC_CHUNK), ("ctx", DEC_CTX),
                                                          ("window", DEC_CTX)))
    return attn, Launch("merge", "attn_merge", (), (), common)


@pytest.mark.parametrize("pos", [0, DEC_CHUNK - 1, DEC_CHUNK, 3 * DEC_CHUNK + 5, DEC_CTX - 1])
def test_decode_primitives_and_merge_give_the_simulated_device_s_attention(hk, pos):
    """Split s of each KV head streams chunks s, s + splits, ... up to the one holding `pos`
    through the decode primitives, the merge combines the splits: the simulated device's
    `decode_attn` + `attn_merge` (the NPU's contract), to f32 summation order."""
    from npu_runtime.sim import ops

    prims, merge = _decode_kernels()
    rng = np.random.default_rng(pos)
    q = rand_bf16(rng, (DEC_KV_HEADS, DEC_GROUP, DEC_DIM))
    k, v = (rand_bf16(rng, (DEC_KV_HEADS, DEC_CTX, DEC_DIM)) for _ in range(2))
    acc = np.zeros((DEC_KV_HEADS, DEC_SPLITS, DEC_GROUP, DEC_DIM), np.float32)
    stats = np.zeros((DEC_KV_HEADS, DEC_SPLITS, DEC_GROUP, 2), np.float32)
    live = (pos + DEC_CHUNK) // DEC_CHUNK
    for h in range(DEC_KV_HEADS):
        for sp in range(DEC_SPLITS):
            m, l = np.empty(DEC_GROUP, np.float32), np.empty(DEC_GROUP, np.float32)
            a = np.empty((DEC_GROUP, DEC_DIM), np.float32)
            hk(prims["init"].symbol, m, l, a)
            for c in range(sp, live, DEC_SPLITS):
                rows = slice(c * DEC_CHUNK, (c + 1) * DEC_CHUNK)
                s = np.empty((DEC_GROUP, DEC_CHUNK), np.float32)
                hk(prims["qk"].symbol, q[h], np.ascontiguousarray(k[h, rows]), s)
                if (c + 1) * DEC_CHUNK - 1 > pos:
                    hk(prims["mask"].symbol, s, pos, c * DEC_CHUNK)
                p, corr = np.empty((DEC_GROUP, DEC_CHUNK), BF16), np.empty(DEC_GROUP, np.float32)
                hk(prims["softmax"].symbol, s, m, l, p, corr)
                hk(prims["pv"].symbol, p, np.ascontiguousarray(v[h, rows]), corr, a)
            acc[h, sp], stats[h, sp, :, 0], stats[h, sp, :, 1] = a, m, l
    got = np.empty((DEC_KV_HEADS, DEC_GROUP, DEC_DIM), BF16)
    for h in range(DEC_KV_HEADS):
        hk(merge.symbol, acc[h], stats[h], got[h])

    attn, merge_launch = _decode_launches()
    want_acc, want_stats = torch.zeros(acc.shape), torch.zeros(stats.shape)
    ops.decode_attn(attn, torch_bf16(q).reshape(-1), torch_bf16(k), torch_bf16(v), torch.tensor([pos], dtype=torch.int32),
                    want_acc, want_stats)
    want = torch.zeros(got.size, dtype=torch.bfloat16)
    ops.attn_merge(merge_launch, want_acc, want_stats, want)
    np.testing.assert_allclose(stats, want_stats.numpy(), rtol=1e-5, atol=1e-6)
    ref.assert_within_ulps(got.reshape(-1), want, 1, ref.REORDERED)


# --- signatures ------------------------------------------------------------------------

_LINEMARK = re.compile(r'^# \d+ "([^"]+)"')
_EXTERN_C = re.compile(r'extern\s+"C"\s+void\s+(\w+)\s*\(([^)]*)\)')


def exported_signatures(kernel):
    """`extern "C"` functions of the kernel's own files after preprocessing with its defines,
    each as its parameters' types: 'const bf16 *__restrict x' -> ['bf16', '*']."""
    return {name: [_param_type(p) for p in params] for name, params in exported_params(kernel).items()}


def exported_params(kernel):
    """`extern "C"` functions of the kernel's own files, each as its parameter declarations."""
    tc = host_toolchain()
    cmd = [str(tc.cxx), "-E", *HOST_FLAGS, *define_flags(kernel), str(KERNELS_DIR / kernel.source)]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    own, current = [], ""
    for line in text.splitlines():
        mark = _LINEMARK.match(line)
        if mark:
            current = mark.group(1)
        elif current.startswith(str(KERNELS_DIR)):
            own.append(line)
    return {name: params.split(",") for name, params in _EXTERN_C.findall("\n".join(own))}


def _param_type(param: str) -> list[str]:
    tokens = re.sub(r"\b(const|__restrict)\b", " ", param).replace("*", " * ").split()
    return tokens[:-1]  # the last token is the parameter's name


def _c_param(arg: ArgType) -> list[str]:
    c_type = ELEMENT_TYPES[arg.dtype][0]
    return [c_type, "*"] if arg.shape is not None else [c_type]


def every_format(cfg):
    from kernel_builder.fused_groups import cache_capacity, fused_decode

    return [g for quant in ("bf16", q4nx.NAME)
            for g in all_groups(cfg, prefill_buckets(cfg), quant=quant) + [fused_decode(cfg, cache_capacity(cfg, 512, 128), quant)]]


@pytest.mark.parametrize("cfg", [LLAMA, SMOLLM2], ids=["llama-3.2-1b", "smollm2-135m"])
def test_extern_c_signatures_match_the_mlir_declarations(cfg):
    kernels = externs_for_groups(every_format(cfg))
    assert {"gemv", "rope", "silu", "attn", "dequant"} <= {k.symbol.split("_")[0] for k in kernels}
    assert {"attn_merge", "attn_mask"} <= {"_".join(k.symbol.split("_")[:2]) for k in kernels}
    for k in kernels:
        sigs = exported_signatures(k)
        assert list(sigs) == [k.symbol], f"{k.source} with {k.defines} exports {list(sigs)}"
        want = [_c_param(ArgType.parse(t)) for t in k.arg_types]
        assert sigs[k.symbol] == want, f"{k.symbol}: {sigs[k.symbol]} != {want}"


def test_declared_reads_and_writes_follow_the_c_signatures():
    """A `const` buffer is only read; every other buffer is written (and read too, where the
    kernel updates it in place, which `const` cannot tell: those are listed by hand)."""
    kernels = externs_for_groups(every_format(LLAMA))
    for k in kernels:
        params = exported_params(k)[k.symbol]
        buffers = [i for i, t in enumerate(k.arg_types) if ArgType.parse(t).shape is not None]
        const = {i for i in buffers if re.search(r"\bconst\b", params[i])}
        assert set(k.writes) == set(buffers) - const, k.symbol
        assert const <= set(k.reads) <= set(buffers), k.symbol


# --- host binding ----------------------------------------------------------------------

def test_host_binding_rejects_buffers_that_do_not_fit_the_declared_memref(hk):
    k = _gemv_kernels()[0]
    tm, kk = dict(k.defines)["GEMV_TILE_M"], dict(k.defines)["GEMV_K"]
    w, y = np.zeros((tm, kk), BF16), np.zeros(tm, BF16)
    with pytest.raises(ValueError, match="shape"):
        hk(k.symbol, w, np.zeros(kk // 2, BF16), y)
    with pytest.raises(TypeError, match="dtype"):
        hk(k.symbol, w, np.zeros(kk, np.float32), y)
    with pytest.raises(TypeError, match="arguments"):
        hk(k.symbol, w, y)


# --- object build ----------------------------------------------------------------------

def test_externs_for_launch_covers_exactly_the_external_ops():
    g = build_group("rms_gemms_rope", LLAMA, presets.PREFILL_BUCKETS[0])
    by_op = {l.op: externs.externs_for_launch(l) for l in g.launches}
    assert by_op["rmsnorm"] == [] and by_op["gemm"] == []
    assert [k.symbol for k in by_op["rope"]] == [externs.rope(LLAMA.head_dim).symbol]


def test_without_peano_every_object_is_skipped_with_the_reason(tmp_path, monkeypatch):
    empty = tmp_path / "no-peano"
    empty.mkdir()
    monkeypatch.setenv("PEANO_INSTALL_DIR", str(empty))
    out = tmp_path / "objs"
    results = build_objects([externs.rope(LLAMA.head_dim), *_gemv_kernels()], out)
    assert [r.status for r in results] == ["skipped"] * 3
    assert all("PEANO_INSTALL_DIR" in r.reason for r in results)
    assert "skipped" in str(results[0]) and not list(out.glob("*.o"))


def test_peano_builds_every_llama_object(tmp_path):
    try:
        tc = find_peano()
    except ToolchainNotFound as e:
        pytest.skip(f"skipped: {e}")
    kernels = externs_for_groups(every_format(LLAMA))
    results = build_objects(kernels, tmp_path, tc)
    assert [r.status for r in results] == ["built"] * len({k.link_object for k in kernels})
    assert all(r.obj.stat().st_size > 0 for r in results)


# A stand-in compiler or linker: logs its command line (behind `tag`) and writes `content` to
# whatever follows -o; `--version` answers with `version`.
FAKE_TOOL = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake-clang {version}"; exit 0; fi
echo "{tag}$*" >> "{log}"
prev=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then printf {content} > "$a"; fi
  prev="$a"
done
"""


def fake_cxx(version: str, log) -> str:
    return FAKE_TOOL.format(version=version, log=log, tag="", content="obj")


def test_objects_rebuild_only_when_their_stamp_changes(tmp_path):
    src = tmp_path / "kernels"
    shutil.copytree(KERNELS_DIR, src)
    log, cxx = tmp_path / "calls.log", tmp_path / "fake-clang++"

    def set_compiler(version):
        cxx.write_text(fake_cxx(version, log))
        cxx.chmod(0o755)
        # A reinstalled compiler has a new mtime; make that hold on coarse-timestamp filesystems too.
        ns = int(float(version) * 1e9)
        os.utime(cxx, ns=(ns, ns))

    def build(kernels):
        before = log.read_text().count("\n") if log.exists() else 0
        res = build_objects(kernels, tmp_path / "objs", Toolchain(cxx, PEANO_FLAGS), src)
        return [r.status for r in res], log.read_text().count("\n") - before

    set_compiler("1.0")
    rope, gemv = externs.rope(LLAMA.head_dim), _gemv_kernels()[0]
    assert build([rope, gemv]) == (["built", "built"], 2)
    calls = log.read_text()
    assert f"--target={PEANO_TARGET}" in calls and f"-DGEMV_SYMBOL={gemv.symbol}" in calls
    assert build([rope, gemv]) == (["up-to-date", "up-to-date"], 0)

    (src / "gemv_bf16.cc").touch()                                   # same bytes: still current
    assert build([rope, gemv])[0] == ["up-to-date", "up-to-date"]
    (src / "gemv_bf16.cc").write_text((src / "gemv_bf16.cc").read_text() + "\n// edited\n")
    assert build([rope, gemv]) == (["up-to-date", "built"], 1)
    (src / "bf16.h").write_text((src / "bf16.h").read_text() + "\n// edited\n")  # a shared header
    assert build([rope, gemv]) == (["built", "built"], 2)

    redefined = dataclasses.replace(gemv, defines=gemv.defines + (("GEMV_UNROLL", 2),))
    assert build([rope, redefined]) == (["up-to-date", "built"], 1)
    set_compiler("2.0")
    assert build([rope, redefined]) == (["built", "built"], 2)
    (tmp_path / "objs" / rope.obj).unlink()
    assert build([rope, redefined]) == (["built", "up-to-date"], 1)


def test_the_peano_command_line_is_what_aie2p_kernels_need():
    """Checked without Peano: the exact command the build would run for one kernel."""
    tc = peano_toolchain(Path("/opt/peano"), Path("/opt/mlir_aie/include"))
    rope = externs.rope(LLAMA.head_dim)
    cmd = tc.compile_command(rope, KERNELS_DIR / rope.source, Path("/out/x.o"))
    assert cmd[0] == "/opt/peano/bin/clang++"
    # aie.hpp pulls in the ADF graph wrappers under __AIENGINE__ unless their guard is defined
    assert "-D__AIE_API_AIE_ADF_HPP__" in cmd
    assert {f"--target={PEANO_TARGET}", "-std=c++20", "-O2", "-I/opt/mlir_aie/include",
            f"-DROPE_SYMBOL={rope.symbol}"} <= set(cmd)
    assert cmd[-4:] == ["-c", str(KERNELS_DIR / rope.source), "-o", "/out/x.o"]


def test_the_attention_primitives_are_built_into_the_one_object_their_herd_links(tmp_path):
    log, cxx = tmp_path / "calls.log", tmp_path / "bin" / "clang++"
    cxx.parent.mkdir()
    cxx.write_text(fake_cxx("1.0", log))
    (cxx.parent / "ld.lld").write_text(FAKE_TOOL.format(version="1.0", log=log, tag="ld ", content="bundle"))
    for f in (cxx, cxx.parent / "ld.lld"):
        f.chmod(0o755)
    prims = externs.attention(64, 32)
    res = build_objects([externs.rope(64), *prims], tmp_path / "objs", Toolchain(cxx, PEANO_FLAGS))
    assert [r.obj.name for r in res] == [externs.rope(64).obj, "attn_d64_t32.o"]
    assert {k.link_object for k in prims} == {"attn_d64_t32.o"}
    calls = log.read_text().splitlines()
    links = [c for c in calls if c.startswith("ld ")]
    assert len(calls) == 1 + len(prims) + 1 and len(links) == 1 and " -r " in links[0]
    assert all(f"-DATTN_SYMBOL={k.symbol}" in log.read_text() for k in prims)
    assert (tmp_path / "objs" / "attn_d64_t32.o").read_text() == "bundle"
    assert not list((tmp_path / "objs").glob(".*.unit")) and not list((tmp_path / "objs").glob(".*.tmp"))
    again = build_objects([externs.rope(64), *prims], tmp_path / "objs", Toolchain(cxx, PEANO_FLAGS))
    assert [r.status for r in again] == ["up-to-date", "up-to-date"]
