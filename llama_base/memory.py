"""Host memory that costs only what is used."""
from __future__ import annotations

import math
import mmap

import torch


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous mapping of their own: a page becomes resident when it is first
    written, so memory follows what is used rather than what is reserved (the KV cache holds
    `max_context` positions, a prompt writes the first ones of each head's block). torch.zeros
    would write, and so make resident, every byte at once."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.uint8).view(dtype).view(shape)
