"""A GGUF weight's values in bf16, for the import (`gguf.importer`).

gguf-py's `dequantize` works through numpy a group of rows at a time on one core: 13 s of a
first run of a Q4_K_M file of Llama-3.2-1B's shape on a 2-core Zen 3. The types llama.cpp's
4-bit files are made of (Q4_0, Q4_1, Q4_K, with Q6_K and Q8_0 for the tensors they keep wider)
are read here with torch, a few thousand rows at a time so the temporaries stay in the caches;
any other type goes to gguf-py. Every product is exact in f32 (an fp16 scale times an integer
below 2^12) and every sum is gguf-py's own, in its order, so the values equal gguf-py's bit for
bit, and so do their bf16 roundings.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from llama_runtime.checkpoints import quantize
from llama_runtime.checkpoints.gguf.reader import Tensor

_CHUNK_WEIGHTS = 1 << 20        # weights dequantized at once: f32 temporaries of a few MiB

Q6_K_WEIGHTS, Q6_K_BYTES = 256, 210   # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d
Q8_0_WEIGHTS, Q8_0_BYTES = 32, 34     # fp16 d, 32 int8 values


def _fp16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _affine(fields, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """Values of a type read as Q4_1's fields (q, scale and min per group of 32)."""
    q, d, m = fields(raw, n, k)
    g = d.shape[1]
    return (q.view(n, g, -1).float() * d[..., None] + m[..., None]).view(n, k)


def q4_0_values(raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """Q4_0 as d * (q - 8), not through Q4_1's fields: q d - 8 d is the same number except that a
    q of 8 under a negative d gives +0 where the file's value is -0."""
    q, d, _ = quantize.q4_0_fields(raw, n, k)
    return ((q.view(n, d.shape[1], -1).float() - 8) * d[..., None]).view(n, k)


def q6_k_values(raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """Q6_K: per 256 weights, w = d * scale_j * (q - 32) with 16 int8 scales of 16 weights each.
    Each half of 128 weights takes 64 bytes of low nibbles (weights 0-63 in the low nibbles, 64-127
    in the high ones) and 32 bytes of high bit pairs (bits 0-1 for weights 0-31, 2-3 for 32-63,
    4-5 for 64-95, 6-7 for 96-127), as llama.cpp's `dequantize_row_q6_K` reads them."""
    b = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(n, k // Q6_K_WEIGHTS, Q6_K_BYTES)
    blocks = b.shape[1]
    ql = b[..., :128].reshape(n, blocks, 2, 1, 64)
    qh = b[..., 128:192].reshape(n, blocks, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(n, blocks, 2, 4, 32)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3)
    q = (low | high << 4).to(torch.int16) - 32                                   # [n, blocks, 2, 4, 32]
    scale = b[..., 192:208].contiguous().view(torch.int8).float() * _fp16(b[..., 208:210])
    return (q.reshape(n, blocks, 16, 16).float() * scale[..., None]).view(n, k)


def q8_0_values(raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    b = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(n, k // Q8_0_WEIGHTS, Q8_0_BYTES)
    return (b[..., 2:].contiguous().view(torch.int8).float() * _fp16(b[..., :2])).view(n, k)


_READERS = {
    T.Q4_0: q4_0_values,
    T.Q4_1: lambda raw, n, k: _affine(quantize.q4_1_fields, raw, n, k),
    T.Q4_K: lambda raw, n, k: _affine(quantize.q4_k_fields, raw, n, k),
    T.Q6_K: q6_k_values,
    T.Q8_0: q8_0_values,
}


def values_bf16(t: Tensor) -> torch.Tensor:
    """`t`'s values, [rows, columns] (a vector: [columns]), rounded to bf16 once."""
    from gguf.quants import dequantize

    if t.tensor_type in (T.F32, T.F16):
        return torch.from_numpy(np.array(t.data, dtype=np.float32)).to(torch.bfloat16)
    read = _READERS.get(t.tensor_type)
    if read is None or len(t.shape) != 2:
        return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).to(torch.bfloat16)
    n, k = t.shape
    out = torch.empty(n, k, dtype=torch.bfloat16)
    step = max(1, _CHUNK_WEIGHTS // k)
    for r in range(0, n, step):
        out[r:r + step] = read(t.data[r:r + step], min(step, n - r), k)
    return out
