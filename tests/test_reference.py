"""The reference itself: its functions against HF transformers and float64 where those state the
same math, and its ulp count and assertion on the cases they must get right."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from llama_base.config import LlamaConfig
from verify import reference as ref
from llama_base.rope import generate_rope_lut
from seeded import rand_bf16

bf = torch.bfloat16


def test_rms_is_hf_llama_rmsnorm_bit_for_bit():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w = rand_bf16(5, 576, seed=1, scale=3), rand_bf16(576, seed=2)
    norm = LlamaRMSNorm(576, eps=1e-5).to(bf)
    norm.weight.data.copy_(w)
    with torch.no_grad():
        ref.assert_within_ulps(ref.rms(x, w, 1e-5), norm(x), 0)


def test_rope_is_hf_rotate_half_at_llama_s_scaled_positions():
    """HF's formula in f32 on the table's cos | sin halves, rounded once: the half-split pairing
    (i with i + d/2) and the sign of the rotation."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = LlamaConfig()
    positions = torch.tensor([0, 1, 777, 8191])
    lut = generate_rope_lut(cfg, 8192)[positions]
    h = cfg.head_dim // 2
    cos, sin = (torch.cat([half, half], -1).float() for half in (lut[:, :h], lut[:, h:]))
    q = rand_bf16(4, cfg.num_attention_heads * cfg.head_dim, seed=3)
    qh = q.float().view(4, cfg.num_attention_heads, cfg.head_dim)
    hf, _ = apply_rotary_pos_emb(qh, qh, cos, sin, unsqueeze_dim=1)
    got = ref.rope(q, lut, cfg.num_attention_heads)
    ref.assert_within_ulps(got, hf.reshape(q.shape).to(bf), 0)
    ref.assert_within_ulps(got[0], q[0], 0)                     # position 0 turns nothing


def test_lin_is_the_float64_product_rounded():
    """One rounding of f32 sums: within an ulp of the exact product rounded, rarely off."""
    x, w = rand_bf16(64, 2048, seed=4), rand_bf16(512, 2048, seed=5, scale=0.02)
    exact = (x.double() @ w.double().t()).to(bf)
    ref.assert_within_ulps(ref.lin(x, w), exact, 1, ref.REORDERED, floor=ref.sum_floor(x, w))


@pytest.mark.parametrize("n,t,start", [(1, 40, 39), (16, 48, 32), (32, 32, 0)])
def test_attention_is_float64_softmax_attention_with_its_mask(n, t, start):
    """Causal GQA with query i at position start + i, against float64 arithmetic written out; the
    flash form (probabilities rounded to bf16) within the flash bound's ulps of it, which holds
    at every element (how many elements differ depends on how flat the softmax is)."""
    hq, hk, d = 8, 2, 64
    q, k, v = rand_bf16(n, hq * d, seed=6), rand_bf16(t, hk * d, seed=7), rand_bf16(t, hk * d, seed=8)
    qh = q.double().view(n, hq, d).transpose(0, 1)
    kh, vh = (m.double().view(t, hk, d).transpose(0, 1).repeat_interleave(hq // hk, 0) for m in (k, v))
    s = qh @ kh.transpose(1, 2) / math.sqrt(d)
    s = s.masked_fill(torch.arange(t)[None, :] > torch.arange(start, start + n)[:, None], -math.inf)
    exact = (torch.softmax(s, -1) @ vh).transpose(0, 1).reshape(n, hq * d).to(bf)
    floor = ref.attention_floor(q, k, v, hq, hk, start)
    ref.assert_within_ulps(ref.attention(q, k, v, hq, hk, start), exact, 1, ref.REORDERED, floor=floor)
    ref.assert_within_ulps(ref.flash_attention(q, k, v, hq, hk, start), exact, ref.FLASH_ULPS, floor=floor)


def test_ulps_count_steps_on_one_line_through_zero():
    b = lambda *v: torch.tensor(v, dtype=torch.float32).to(bf)     # noqa: E731
    tiny = torch.tensor([1], dtype=torch.int16).view(bf)          # the smallest subnormal
    assert ref.ulps(b(0.0), b(-0.0)).item() == 0
    assert ref.ulps(tiny, -tiny).item() == 2
    assert ref.ulps(b(1.0), b(1.0078125)).item() == 1              # 1 + 2^-7: the next bf16 after 1
    assert ref.ulps(b(math.inf), torch.tensor([0x7F7F], dtype=torch.int16).view(bf)).item() == 1
    nan_payloads = torch.tensor([0x7FC0, 0x7F81], dtype=torch.int16).view(bf)
    assert ref.ulps(nan_payloads, nan_payloads.flip(0)).tolist() == [0, 0]
    assert ref.ulps(b(math.nan), b(1.0)).item() == math.inf and ref.ulps(b(1.0), b(math.nan)).item() == math.inf
    as_numpy = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16)
    assert ref.ulps(as_numpy, b(1.0, 2.015625)).tolist() == [0, 1]                 # steps of 2^-6 above 2
    with pytest.raises(TypeError, match="bf16"):
        ref.ulps(torch.ones(2), b(1.0, 1.0))


def test_the_assertion_counts_cancelled_values_at_the_floor_and_says_where():
    want = torch.tensor([4.0, 1e-3, 2.0], dtype=bf)
    got = torch.tensor([4.0, 1e-3 + 2 ** -8, 2.0], dtype=bf)    # one step of 1.0 away from a small value
    with pytest.raises(AssertionError, match=r"worst \d+ ulps at flat index 1"):
        ref.assert_within_ulps(got, want, 1)
    ref.assert_within_ulps(got, want, 1, floor=1.0)              # measured in steps of 1.0: one
    with pytest.raises(AssertionError, match="over 0.000% differ"):
        ref.assert_within_ulps(got, want, 1, 0.0, floor=1.0)
    ref.assert_within_ulps(got, want, 1, 0.01, floor=1.0)        # one element may differ, even of three
