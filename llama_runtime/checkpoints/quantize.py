"""Making Q4NX weights: from bf16 matrices, and from the 4-bit blocks of a GGUF Q4_1 file.

From bf16, every group of `q4nx.GROUP` weights gets the scale and min that minimise its squared
error among a few candidates: the group's range (min, (max - min) / 15), then least-squares
refits of scale and min to the values chosen so far, each rounded to bf16 before the values are
chosen against it, so the error measured is the error of the numbers the kernels multiply. The
refit matters because the range fit spends levels on a group's extreme weights; it lowers the
squared error by about a tenth on Gaussian-like groups.

From GGUF Q4_1 (llama.cpp's per-32 affine format, `w = d * q + m` with fp16 `d` and `m`), the
4-bit values are kept exactly and only the fp16 scale and min become bf16: the scale rounds to
nearest, and the min absorbs the scale's rounding over the group's mean value, which is the
least-squares min for the rounded scale. `q4_1_loss` reports what that costs.
"""
from __future__ import annotations

import numpy as np
import torch

from llama_base import q4nx

# Groups quantized at once. Each candidate is a few passes over the chunk, so its f32
# temporaries (2 MiB at this size) should stay in the caches: at 1 << 20 groups (128 MiB each)
# every pass went to DRAM, and the 1B shape's LM head took 28.4 s instead of 6.6 on a Zen 3.
_CHUNK_GROUPS = 1 << 14
_REFITS = 3


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _levels(w: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((w - m[:, None]) / safe[:, None]).clamp_(0, q4nx.LEVELS)
    return torch.where(s[:, None] > 0, q, torch.zeros_like(q))


def _error(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return ((_bf16(q * s[:, None] + m[:, None]) - w) ** 2).sum(1)


def _refit(w: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares scale and min for fixed levels q, each group on its own."""
    n = w.shape[1]
    sq, sw = q.sum(1), w.sum(1)
    det = n * (q * q).sum(1) - sq * sq
    s = (n * (q * w).sum(1) - sq * sw) / torch.where(det > 0, det, torch.ones_like(det))
    s = torch.where(det > 0, s, torch.zeros_like(s))
    return s, (sw - s * sq) / n


def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, min) for rows of one group each: w f32 [G, GROUP] -> uint8 [G, GROUP], bf16 [G], bf16 [G]."""
    lo, hi = w.min(1).values, w.max(1).values
    s, m = _bf16((hi - lo) / q4nx.LEVELS), _bf16(lo)
    q = _levels(w, s, m)
    best = _error(w, q, s, m)
    for _ in range(_REFITS):
        s2, m2 = _refit(w, q)
        s2, m2 = _bf16(s2.clamp_min(0)), _bf16(m2)
        q2 = _levels(w, s2, m2)
        e2 = _error(w, q2, s2, m2)
        better = e2 < best
        s, m, best = torch.where(better, s2, s), torch.where(better, m2, m), torch.where(better, e2, best)
        q = torch.where(better[:, None], q2, q)
    return q.to(torch.uint8), s.to(torch.bfloat16), m.to(torch.bfloat16)


def quantize(w: torch.Tensor) -> torch.Tensor:
    """The Q4NX bytes of a bf16 (or f32) matrix [n, k]."""
    n, k = w.shape
    q4nx.Layout(n, k)
    g = k // q4nx.GROUP
    q = torch.empty(n * g, q4nx.GROUP, dtype=torch.uint8)
    s = torch.empty(n * g, dtype=torch.bfloat16)
    m = torch.empty(n * g, dtype=torch.bfloat16)
    flat = w.reshape(n * g, q4nx.GROUP)
    for i in range(0, n * g, _CHUNK_GROUPS):
        j = min(n * g, i + _CHUNK_GROUPS)
        q[i:j], s[i:j], m[i:j] = quantize_groups(flat[i:j].float())
    return q4nx.pack(q.view(n, k), s.view(n, g), m.view(n, g))


def pad_rows(w: torch.Tensor) -> torch.Tensor:
    """w with zero rows appended up to a whole Q4NX row-block (an LM head's vocabulary need not divide)."""
    extra = -w.shape[0] % q4nx.ROWS
    return w if not extra else torch.cat([w, w.new_zeros(extra, w.shape[1])])


# ---- GGUF Q4_1 ------------------------------------------------------------------------------

Q4_1_BLOCK = 32                 # weights per GGUF Q4_1 block
Q4_1_BYTES = 20                 # fp16 d, fp16 m, 16 bytes of nibbles (element j low, j + 16 high)


def q4_1_fields(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [n, k], d f32 [n, k/32], m f32 [n, k/32]) of a Q4_1 tensor's bytes ([n, k/32*20])."""
    if q4nx.GROUP != Q4_1_BLOCK:
        raise ValueError("Q4_1 blocks and Q4NX groups must cover the same columns")
    b = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(n, k // Q4_1_BLOCK, Q4_1_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    nib = b[..., 4:]
    q = torch.cat([nib & 15, nib >> 4], dim=-1).reshape(n, k)
    return q, d, m


Q4_0_BYTES = 18                 # fp16 d, 16 bytes of nibbles; w = d * (q - 8)


def q4_0_fields(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 as Q4_1's fields: the same values q, scale d and min -8 d (exact in f32)."""
    b = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(n, k // Q4_1_BLOCK, Q4_0_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    nib = b[..., 2:]
    return torch.cat([nib & 15, nib >> 4], dim=-1).reshape(n, k), d, -8 * d


Q4_K_WEIGHTS = 256              # a super-block: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
Q4_K_BYTES = 144
Q4_K_SUB = 32                   # weights per sub-block: one scale and one min


def q4_k_fields(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K as Q4_1's fields. Each 32-weight sub-block j of a super-block holds w = d sc_j q -
    dmin m_j with 6-bit sc_j and m_j: a scale d sc_j and a min -dmin m_j per group of 32, both
    exact in f32 (an fp16 times a 6-bit integer). Within each 64 weights, the low nibbles of 32
    bytes are the first sub-block and the high nibbles the second (llama.cpp's
    `dequantize_row_q4_K`); sc and m of sub-blocks 0-3 are the low 6 bits of bytes 0-3 and 4-7,
    those of 4-7 take their low 4 bits from bytes 8-11 and their top 2 from the top bits of
    bytes 0-3 (sc) and 4-7 (m)."""
    if q4nx.GROUP != Q4_K_SUB:
        raise ValueError("Q4_K sub-blocks and Q4NX groups must cover the same columns")
    b = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(n, k // Q4_K_WEIGHTS, Q4_K_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float()           # [n, blocks, 1]
    dmin = b[..., 2:4].contiguous().view(torch.float16).float()
    sm = b[..., 4:16].to(torch.int32)
    low = torch.cat([sm[..., 0:4] & 63, sm[..., 8:12] & 15 | (sm[..., 0:4] >> 6) << 4], dim=-1)
    mins = torch.cat([sm[..., 4:8] & 63, sm[..., 8:12] >> 4 | (sm[..., 4:8] >> 6) << 4], dim=-1)
    nib = b[..., 16:].reshape(n, k // Q4_K_WEIGHTS, 4, 32)              # 4 chunks of 64 weights
    q = torch.stack([nib & 15, nib >> 4], dim=3).reshape(n, k)
    return q, (d * low.float()).reshape(n, -1), (-dmin * mins.float()).reshape(n, -1)


def q4_1_to_q4nx(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (scale, min) for Q4_1's fp16 (d, m) with the same 4-bit values (see the module doc)."""
    n, g = d.shape
    mean_q = q.view(n, g, q4nx.GROUP).float().mean(-1)
    s = d.to(torch.bfloat16)
    return s, (m + (d - s.float()) * mean_q).to(torch.bfloat16)


def q4_1_loss(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    """What converting Q4_1's scales and mins to bf16 costs: the RMS change of the weights against
    the RMS of Q4_1's own rounding step (d / sqrt(12)), and the largest change in steps of d."""
    s, mn = q4_1_to_q4nx(q, d, m)
    n, g = d.shape
    qg = q.view(n, g, q4nx.GROUP).float()
    exact = qg * d[..., None] + m[..., None]
    ours = _bf16(qg * s.float()[..., None] + mn.float()[..., None])
    diff = ours - exact
    step = d[..., None].clamp_min(1e-30)
    return {"rms_change_over_step_rms": float(diff.pow(2).mean().sqrt() / (d.pow(2).mean().sqrt() / 12 ** 0.5)),
            "max_change_in_steps": float((diff.abs() / step).max())}
