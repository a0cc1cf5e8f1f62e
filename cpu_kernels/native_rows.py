"""Rows of a table read by id from its file, and a 4-bit LM head's rescoring from them, natively.

The embedding table (and a tied LM head's bf16 rows) stays in its checkpoint file rather than
resident: a decode step needs one row of it, and a Q4NX head's rescoring 256
(`llama_runtime.engine.head_rescore`). These entry points serve that table, not a launch of the
simulated device, so they sit apart from the kernels in `native_cpu`, in the same library:
`pread` by id (through `safetensors_io.RowCache` where the caller keeps one), the top-k scan,
the rows' products, and the rescoring's steps fused into one call. Each returns None where
the native library is unavailable, and the caller then takes its torch path.
"""
from __future__ import annotations

import ctypes

import torch

from cpu_kernels import native_cpu


def read_rows(fd: int, offset: int, n_rows: int, ids: torch.Tensor, out: torch.Tensor, cache=None) -> int | None:
    """`pread` rows `ids` (int64) of an n_rows-row matrix at `offset` in the open file `fd` into
    `out` (contiguous, one row per id): -1 when all were read, else the first failing position;
    None if the native library is unavailable. With `cache` (`safetensors_io.RowCache` of these
    rows), rows it holds are copied from it and the rows read enter it."""
    lib = native_cpu.library()
    if lib is None or ids.dtype != torch.int64 or not (ids.is_contiguous() and out.is_contiguous()):
        return None
    row_bytes = out[0].numel() * out.element_size() if len(out) else 0
    if cache is None:
        return lib.read_rows_cpu(fd, offset, row_bytes, n_rows, ids.data_ptr(), len(ids), out.data_ptr())
    return lib.read_rows_cached_cpu(fd, offset, row_bytes, n_rows, ids.data_ptr(), len(ids), out.data_ptr(),
                                    *_row_cache_args(cache))


def read_row(fd: int, offset: int, n_rows: int, i: int, out: torch.Tensor) -> int | None:
    """`read_rows` of the one row `i` into `out` (contiguous, one row's bytes), with no tensor
    made for the id: a decode step's embedding lookup, read straight into the buffer its first
    call takes. -1 when read, 0 when `i` is out of range or the read came up short; None if the
    native library is unavailable or `out` is not contiguous."""
    lib = native_cpu.library()
    if lib is None or not out.is_contiguous():
        return None
    box = ctypes.c_int64(i)
    return lib.read_rows_cpu(fd, offset, out.numel() * out.element_size(), n_rows, ctypes.addressof(box), 1,
                             out.data_ptr())


def _row_cache_args(cache) -> tuple:
    """A `safetensors_io.RowCache` as the native readers take it: slot_of, id_of, used, data,
    capacity, hand."""
    return (cache.slot_of.data_ptr(), cache.id_of.data_ptr(), cache.used.data_ptr(), cache.data.data_ptr(),
            cache.capacity, cache.hand.data_ptr())


RESCORE_TOO_FEW = -2     # rescore_rows: fewer logits than candidates are not NaN


def rescore_rows(logits: torch.Tensor, x: torch.Tensor, fd: int, offset: int, n_rows: int, ids: torch.Tensor,
                 rows: torch.Tensor, cache=None, source: torch.Tensor | None = None) -> int | None:
    """A quantized head's rescoring in one call: the `len(ids)` largest of the f32 `logits` are
    overwritten with their bf16 rows of an n_rows-row matrix at `offset` in the open file `fd`
    (read into `rows`, through `cache` as `read_rows`) times the bf16 vector `x`, rounded to
    bf16; `ids` receives their ids. -1 when done; `RESCORE_TOO_FEW`, nothing changed, when fewer
    than that many logits are not NaN; else the first position whose read failed, the logits unchanged. None
    if the native library is unavailable or an operand is not as described. With `source` (bf16,
    as many values as `logits`), `logits` first receives it widened, whatever the answer but None."""
    lib = native_cpu.library()
    k = ids.numel()
    if (lib is None or logits.dtype != torch.float32 or logits.dim() != 1 or not logits.is_contiguous()
            or not 0 < k <= logits.numel() or ids.dtype != torch.int64 or not ids.is_contiguous()
            or x.dtype != torch.bfloat16 or not x.is_contiguous() or rows.dtype != torch.bfloat16
            or not rows.is_contiguous() or tuple(rows.shape) != (k, x.numel())
            or (source is not None and (source.dtype != torch.bfloat16 or not source.is_contiguous()
                                        or source.numel() != logits.numel()))):
        return None
    c = _row_cache_args(cache) if cache is not None else (None, None, None, None, 0, None)
    return lib.rescore_rows_cpu(source.data_ptr() if source is not None else None, logits.data_ptr(), logits.numel(),
                                k, x.data_ptr(), x.numel(), fd, offset, n_rows, ids.data_ptr(), rows.data_ptr(), *c)


def rows_dot(rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """f32 products of the bf16 rows [n, k] with the bf16 vector x (n values, summed in an
    order of their own); None if the native library is unavailable."""
    lib = native_cpu.usable(rows, x)
    if lib is None or rows.dim() != 2 or x.numel() != rows.shape[1]:
        return None
    out = torch.empty(rows.shape[0], dtype=torch.float32)
    lib.rows_dot_bf16_cpu(rows.data_ptr(), rows.shape[0], rows.shape[1], x.data_ptr(), out.data_ptr())
    return out


def top_k_ids(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """The ids of the k largest of the f32 vector x (int64, in no order; of equal values the lower
    id first; NaN never); None if the native library is unavailable or fewer than k values of x
    are not NaN."""
    lib = native_cpu.library()
    if lib is None or x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous() or not 0 < k <= x.numel():
        return None
    ids = torch.empty(k, dtype=torch.int64)
    lib.top_k_ids_cpu(x.data_ptr(), x.numel(), k, ids.data_ptr())
    return None if ids[-1] < 0 else ids
