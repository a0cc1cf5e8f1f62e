"""Memory-mapped, validating reader for (sharded) safetensors checkpoints.

We parse the safetensors header ourselves instead of calling `safetensors.safe_open` so that
(1) tensors are zero-copy views of a private file mapping (a 2.5 GB checkpoint costs page
cache, not a second heap copy, until the KernelCache uploads it) and (2) a truncated or
corrupted file is reported as one line naming the file and the tensor, before any compute.
Only the safetensors format is read: pickled checkpoints are never loaded.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from pathlib import Path

import numpy as np
import torch

from cpu_kernels import native_cpu, native_rows
from llama_base.errors import CheckpointError
from llama_base.memory import untouched_zeros

_DTYPES = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
    "U8": (torch.uint8, 1),     # quantized weights' bytes (llama_runtime.checkpoints.q4nx_weights)
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One .safetensors file: header parsed and checked, tensors served as mmap views."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
                (hlen,) = struct.unpack("<Q", head)
                if hlen > _MAX_HEADER or 8 + hlen > size:
                    raise CheckpointError(f"{self.path}: truncated or corrupted safetensors header")
                header = json.loads(f.read(hlen))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{self.path}: corrupted safetensors header (not JSON)") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + hlen
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: corrupted header entry for tensor {name!r}") from None
            if self._data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: truncated file: tensor {name!r} ends at byte "
                    f"{self._data_start + end} but the file has {size} bytes"
                )
            self._entries[name] = (dtype, shape, begin, end)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="c") if size > 0 else None

    def names(self) -> list[str]:
        return list(self._entries)

    def release_pages(self) -> None:
        """Drop the mapping's resident pages; views stay valid and fault back in from the file.

        Preload copies each weight into a device buffer once; without this the copied-from pages
        would stay resident too and the process would briefly hold every weight twice.
        """
        m = getattr(self._map, "_mmap", None)
        if m is not None and hasattr(m, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            m.madvise(mmap.MADV_DONTNEED)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        dtype, shape, _, _ = self._entries[name]
        return dtype, shape

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy view of the named tensor (copy-on-write mapping: writes never reach disk)."""
        dtype, shape, begin, end = self._entries[name]
        if dtype not in _DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has dtype {dtype}; expected BF16 (or F16/F32, converted; U8 bytes)"
            )
        tdtype, itemsize = _DTYPES[dtype]
        count = int(np.prod(shape)) if shape else 1
        if (end - begin) != count * itemsize:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has {end - begin} bytes, shape {list(shape)} needs {count * itemsize}"
            )
        raw = self._map[self._data_start + begin : self._data_start + end]
        return torch.from_numpy(raw).view(tdtype).reshape(shape)


    def contains(self, t: torch.Tensor) -> int | None:
        """The file offset of `t`'s first byte when `t` is a view into this file's mapping."""
        if self._map is None:
            return None
        base = self._map.ctypes.data
        offset = t.data_ptr() - base
        return offset if 0 <= offset and offset + t.numel() * t.element_size() <= self._map.size else None


PREFETCH_WINDOW = 128 << 10     # bytes a WILLNEED asks for (`FileRows.prefetch`): Linux's default readahead


class RowCache:
    """The last rows a `FileRows` read, up to `capacity` of them, for the native reader
    (`native_rows.read_rows`, whose source says how slots are reused). A 4-bit head's rescored
    candidates recur from token to token on a trained model, and a row held here is a copy
    rather than a system call. Its rows are resident only once used (`untouched_zeros`)."""

    def __init__(self, n_rows: int, row_bytes: int, capacity: int):
        self.capacity = capacity
        self.slot_of = torch.full((n_rows,), -1, dtype=torch.int32)
        self.id_of = torch.full((capacity,), -1, dtype=torch.int64)
        self.used = torch.zeros(capacity, dtype=torch.uint8)
        self.hand = torch.zeros(1, dtype=torch.int64)
        self.data = untouched_zeros((capacity, row_bytes), torch.uint8)


class FileRows:
    """Rows of a row-major matrix read from its file with `pread`, at token ids.

    The host reads a few rows of the embedding table per token (the lookup, a quantized head's
    rescored candidates): through the mapping, every fault would also map the pages around it
    (the kernel's fault-around), so a few hundred candidates a token would make the whole table
    resident within a few dozen tokens. Read this way, only what the reader keeps stays
    resident: with `cache_bytes`, a `RowCache` of that size holds the rows read last (once the
    native library is there); the page cache serves the rest, one native call for all rows of a
    step (`native_rows.read_rows`).
    """

    def __init__(self, path: Path, offset: int, shape: tuple[int, int], dtype: torch.dtype, cache_bytes: int = 0):
        self.path, self.offset, self.shape, self.dtype = path, offset, shape, dtype
        self.row_bytes = shape[1] * torch.empty(0, dtype=dtype).element_size()
        self._fd = os.open(path, os.O_RDONLY)
        self._cache_rows = min(cache_bytes // self.row_bytes, shape[0])
        self.cache: RowCache | None = None       # made on the first native read
        self._lock = threading.Lock()            # the cache's bookkeeping is one reader's at a time
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None   # `rescore`'s ids and rows

    def prefetch(self) -> threading.Thread | None:
        """Ask the page cache for the whole table, in the background, for a reader of a few
        hundred scattered rows a token: from a cold file each of them would be a disk read, and
        the rows of one step would take longer than the step's GEMVs.

        One WILLNEED reads no more than the device's readahead window (Linux caps it at the
        larger of read_ahead_kb and the device's I/O size: on the Zen 3 VM's 6.18 kernel a call
        over 512 MiB read 8 MiB of it, and rows of the rest then came from disk at 9-15 us
        each). So the table is asked for window by window, `PREFETCH_WINDOW` at a time (the
        default read_ahead_kb), from a thread of its own: a few thousand calls, the reads
        themselves asynchronous (512 MiB were resident within half a second there)."""
        if not hasattr(os, "posix_fadvise"):
            return None
        total, fd = self.shape[0] * self.row_bytes, self._fd

        def ask() -> None:
            try:
                for start in range(0, total, PREFETCH_WINDOW):
                    os.posix_fadvise(fd, self.offset + start, min(PREFETCH_WINDOW, total - start),
                                     os.POSIX_FADV_WILLNEED)
            except OSError:
                pass            # the reader was closed meanwhile: advice, nothing lost

        thread = threading.Thread(target=ask, name="table-prefetch", daemon=True)
        thread.start()
        return thread

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(idx), self.shape[1], dtype=self.dtype)
        ids = idx.to(torch.int64).contiguous()
        with self._lock:
            failed = native_rows.read_rows(self._fd, self.offset, self.shape[0], ids, out, self._native_cache())
        if failed is None:
            failed = self._read_each(ids.tolist(), out)
        self._check(ids, failed)
        return out

    def read_into(self, i: int, out: torch.Tensor) -> bool:
        """Row `i` read into `out` (contiguous, one row of this dtype), uncached; False where
        the native library cannot (the caller reads it the other way)."""
        if out.dtype != self.dtype or out.numel() != self.shape[1]:
            raise ValueError(f"a row of {self.shape[1]} {self.dtype} values, not {out.numel()} {out.dtype}")
        failed = native_rows.read_row(self._fd, self.offset, self.shape[0], i, out)
        if failed is None:
            return False
        if failed >= 0:
            self._check(torch.tensor([i]), failed)
        return True

    def rescore(self, logits: torch.Tensor, x: torch.Tensor, k: int,
                source: torch.Tensor | None = None) -> torch.Tensor | None:
        """`head_rescore.rescore` over these rows in one native call (`native_rows.rescore_rows`):
        the ids of the k largest of `logits`, those logits recomputed from their rows times `x`;
        None where that call cannot serve (no native library, fewer than k logits not NaN), with
        nothing changed but, given a bf16 `source`, `logits` holding it widened where the call
        was made."""
        if self.dtype != torch.bfloat16 or not native_cpu.available():
            return None
        with self._lock:
            cache = self._native_cache()
            if self._scratch is None or len(self._scratch[0]) != k:
                self._scratch = (torch.empty(k, dtype=torch.int64), torch.empty(k, self.shape[1], dtype=self.dtype))
            ids, rows = self._scratch
            failed = native_rows.rescore_rows(logits, x, self._fd, self.offset, self.shape[0], ids, rows, cache,
                                              source)
            if failed is None or failed == native_rows.RESCORE_TOO_FEW:
                return None
            self._check(ids, failed)
            return ids.clone()

    def _native_cache(self) -> RowCache | None:
        """The row cache, made on the first native read (under the lock); None without one."""
        if self.cache is None and self._cache_rows > 0 and native_cpu.available():
            self.cache = RowCache(self.shape[0], self.row_bytes, self._cache_rows)
        return self.cache

    def _check(self, ids: torch.Tensor, failed: int) -> None:
        """Raise for a read that failed at position `failed` (-1: none did)."""
        if failed >= 0:
            i = int(ids[failed])
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"row {i} of a {self.shape[0]}-row matrix")
            raise CheckpointError(f"{self.path}: short read of row {i} (the file changed under the runtime?)")

    def _read_each(self, ids: list[int], out: torch.Tensor) -> int:
        """The same reads from Python, where the native library is unavailable."""
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        rb = self.row_bytes
        for j, i in enumerate(ids):
            if not 0 <= i < self.shape[0] or os.preadv(self._fd, [view[j * rb:(j + 1) * rb]],
                                                       self.offset + i * rb) != rb:
                return j
        return -1

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


class Checkpoint:
    """All tensors of a checkpoint folder, single-file or sharded (model.safetensors.index.json)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        self._where: dict[str, SafetensorsFile] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index}: corrupted shard index (no weight_map)") from None
            files: dict[str, SafetensorsFile] = {}
            for name, shard in weight_map.items():
                if shard not in files:
                    shard_path = self.folder / shard
                    if not shard_path.is_file():
                        raise CheckpointError(f"{index}: shard {shard!r} (tensor {name!r}) is missing")
                    files[shard] = SafetensorsFile(shard_path)
                self._where[name] = files[shard]
        else:
            shards = sorted(self.folder.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.folder}: no .safetensors file (only safetensors checkpoints are supported)")
            for shard in shards:
                st = SafetensorsFile(shard)
                for name in st.names():
                    self._where[name] = st

    def _files(self) -> list[SafetensorsFile]:
        """Each file once (a sharded checkpoint maps many names to one file)."""
        return list({id(f): f for f in self._where.values()}.values())

    def release_pages(self) -> None:
        for st in self._files():
            st.release_pages()

    def rows_of(self, t: torch.Tensor, cache_bytes: int = 0) -> FileRows | None:
        """A `FileRows` reader of `t` when it is a 2-D view of one of these files, else None."""
        if t.dim() != 2 or not t.is_contiguous():
            return None
        for st in self._files():
            offset = st.contains(t)
            if offset is not None:
                return FileRows(st.path, offset, tuple(t.shape), t.dtype, cache_bytes)
        return None

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def dtype_of(self, name: str) -> str:
        """The named tensor's dtype as the file spells it ("BF16", "U8", ...), or a one-line error."""
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        return self._where[name].info(name)[0]

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor as bf16 with the expected shape, or a one-line error naming it."""
        t = self.get_raw(name, shape)
        return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)

    def get_raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor as stored (a zero-copy view), with the expected shape, or a one-line error."""
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        st = self._where[name]
        found = st.info(name)[1]
        if tuple(found) != tuple(shape):
            raise CheckpointError(
                f"{self.folder}: tensor {name!r} has shape {list(found)}, expected {list(shape)}"
            )
        return st.tensor(name)
