"""Plain-torch statements of what each kernel group computes, written independently of sim_ops.

f32 math from bf16 operands, rounded to bf16 where a launch stores its result. Used to check
the simulated device (and, through the same declarations, what the NPU must compute).
"""
from __future__ import annotations

import torch

from llama_runtime.host_ops import reference_attention

bf = torch.bfloat16


def rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(bf)


def lin(x, w):
    return (x.float() @ w.float().t()).to(bf)


def rope(x, lut, heads):
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
    h = rms(x, lw.attn_norm, cfg.rms_norm_eps)
    return {"q": rope(lin(h, lw.wq), lut, cfg.num_attention_heads),
            "k": rope(lin(h, lw.wk), lut, cfg.num_key_value_heads),
            "v": lin(h, lw.wv)}


def o_ffn(cfg, lw, attn, x):
    h1 = (x.float() + lin(attn, lw.wo).float()).to(bf)
    n = rms(h1, lw.ffn_norm, cfg.rms_norm_eps)
    g, u = lin(n, lw.w_gate), lin(n, lw.w_up)
    act = (torch.nn.functional.silu(g.float()) * u.float()).to(bf)
    return {"out": (h1.float() + lin(act, lw.w_down).float()).to(bf)}
