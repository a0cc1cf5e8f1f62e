"""The model's math as short plain-torch functions: the contract every device is tested against.

Written independently of the simulator's ops and the native kernels: f32 math from bf16
operands, and a rounding to bf16 exactly where a launch stores its result, plus one inside
RMSNorm where HF rounds (the normalised row, before the weight multiply). The simulated
device, the native CPU kernels and the interpreter are each compared with these, within a
stated number of bf16 ulps.
"""
from __future__ import annotations

import torch

from llama_runtime.host_ops import reference_attention

bf = torch.bfloat16


def rms(x, w, eps):
    """RMSNorm with HF's two roundings: the normalised row to bf16, then its product with the weight."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(bf)
    return (normed.float() * w.float()).to(bf)


def lin(x, w):
    """x Wᵀ: bf16 products summed in f32, one rounding."""
    return (x.float() @ w.float().t()).to(bf)


def rope(x, lut, heads):
    """Half-split RoPE (HF `rotate_half`) with the cos | sin table row of each position, one rounding."""
    n = x.shape[0]
    d = lut.shape[-1]
    h = d // 2
    xf = x.float().reshape(n, heads, d)
    c, s = lut.float()[:, None, :h], lut.float()[:, None, h:]
    a, b = xf[..., :h], xf[..., h:]
    return torch.cat([a * c - b * s, b * c + a * s], -1).reshape(n, heads * d).to(bf)


def attention(q, k, v, hq, hk):
    return reference_attention(q, k, v, hq, hk)


def rms_gemms_rope(cfg, lw, x, lut):
    """The attention half's projections: each launch rounds what it stores."""
    h = rms(x, lw.attn_norm, cfg.rms_norm_eps)
    return {"q": rope(lin(h, lw.wq), lut, cfg.num_attention_heads),
            "k": rope(lin(h, lw.wk), lut, cfg.num_key_value_heads),
            "v": lin(h, lw.wv)}


def o_ffn(cfg, lw, attn, x):
    """O projection, residual, RMSNorm, SwiGLU MLP, residual: each launch rounds what it stores."""
    h1 = (x.float() + lin(attn, lw.wo).float()).to(bf)
    n = rms(h1, lw.ffn_norm, cfg.rms_norm_eps)
    g, u = lin(n, lw.w_gate), lin(n, lw.w_up)
    act = (torch.nn.functional.silu(g.float()) * u.float()).to(bf)
    return {"out": (h1.float() + lin(act, lw.w_down).float()).to(bf)}
