"""A GGUF file's metadata and tensors, read without parsing its vocabulary.

gguf-py's `GGUFReader` builds a numpy view for every string of every array, and a Llama 3
GGUF holds 128 256 tokens and 280 147 merges: 13 s of a 2-core Zen 3 before the first weight
could be read, three times over on a first `QUANT=q4nx` run (the import, the tokenizer, the
Q4NX build). The runtime needs only the scalars and the tensors. So string arrays are only
counted, numeric arrays are one `frombuffer` each, and the tensors are views of one read-only
memory map, laid out as gguf-py lays them out (so `gguf.quants.dequantize` takes them as they
are). The tokenizer is left to transformers, which reads the vocabulary its own way.

Every way a file can be broken (not a GGUF, cut in its header, cut in its tensor data, an
unknown type) is one `CheckpointError` line naming the file.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from llama_base.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)          # version 1 (32-bit lengths) predates every Llama 3 file
DEFAULT_ALIGNMENT = 32     # where the tensor data starts, unless `general.alignment` says otherwise
_STRING, _ARRAY = 8, 9
# GGUF value types with a fixed width: struct format and numpy dtype (little-endian).
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Tensor types gguf-py gives as typed elements; every other type is given as bytes per row.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class _Cut(Exception):
    """The header ends before a value it announces."""


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]      # slowest dimension first, as a HF weight's (GGUF lists them fastest first)
    data: np.ndarray            # typed elements, or uint8 [*shape[:-1], bytes per row] for block types


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise _Cut
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise _Cut
        self.pos += n
        return str(self.buf[self.pos - n:self.pos], "utf-8")

    def skip_strings(self, count: int) -> None:
        buf, pos, end = self.buf, self.pos, len(self.buf)
        for _ in range(count):
            if pos + 8 > end:
                raise _Cut
            pos += 8 + int.from_bytes(buf[pos:pos + 8], "little")
        if pos > end:
            raise _Cut
        self.pos = pos

    def scalar(self, kind: int):
        if kind in _FIXED:
            return self.take(_FIXED[kind])
        if kind == _STRING:
            return self.string()
        raise ValueError(f"unknown metadata value type {kind}")

    def array(self, item: int, count: int) -> np.ndarray:
        dtype = np.dtype("<" + _FIXED[item])
        if self.pos + count * dtype.itemsize > len(self.buf):
            raise _Cut
        out = np.frombuffer(self.buf, dtype, count, self.pos).copy()
        self.pos += count * dtype.itemsize
        return out

    def skip_array(self, item: int, count: int) -> None:
        """Past an array of strings or of arrays, which the runtime only counts."""
        if item == _STRING:
            self.skip_strings(count)
        elif item == _ARRAY:
            for _ in range(count):
                self.skip_array(self.take("I"), self.take("Q"))
        elif item in _FIXED:
            self.array(item, count)
        else:
            raise ValueError(f"unknown metadata value type {item}")


class GGUFFile:
    """`fields`: every metadata value (scalars, strings, numeric arrays); an array of strings
    (or of arrays) appears in `counts` instead, as its number of entries. `tensors`: in the
    file's order."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:   # ValueError: an empty file cannot be mapped
            raise self._error(f"cannot be mapped ({e})") from None
        try:
            self._parse(_Cursor(memoryview(self._map)))
        except _Cut:
            raise self._error("cut short inside its header") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise self._error(str(e)) from None

    def _error(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable GGUF file ({why})")

    def _parse(self, cur: _Cursor) -> None:
        if bytes(cur.buf[:4]) != MAGIC:
            raise ValueError("no GGUF magic at its start")
        cur.pos = 4
        version = cur.take("I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version}; this reader takes versions {VERSIONS} in little-endian")
        n_tensors, n_fields = cur.take("Q"), cur.take("Q")
        self.fields, self.counts = {}, {}
        for _ in range(n_fields):
            name, kind = cur.string(), cur.take("I")
            if kind != _ARRAY:
                self.fields[name] = cur.scalar(kind)
                continue
            item, count = cur.take("I"), cur.take("Q")
            if item in _FIXED:
                self.fields[name] = cur.array(item, count)
            else:
                cur.skip_array(item, count)
                self.counts[name] = count
        infos = []
        for _ in range(n_tensors):
            name, n_dims = cur.string(), cur.take("I")
            dims = [cur.take("Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.take("I"), cur.take("Q")))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0:
            raise ValueError(f"general.alignment is {align}")
        start = -(-cur.pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _tensor(self, start: int, name: str, dims: list[int], type_id: int, offset: int) -> Tensor:
        try:
            kind = GGMLQuantizationType(type_id)
            block, block_bytes = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type {type_id}") from None
        if not dims or dims[0] % block:
            raise ValueError(f"tensor {name!r} of type {kind.name} has {dims[:1]} columns, not whole blocks of {block}")
        nbytes = math.prod(dims) // block * block_bytes
        at = start + offset
        if at + nbytes > len(self._map):
            raise ValueError(f"cut short inside tensor {name!r}")
        shape = tuple(reversed(dims))
        raw = np.frombuffer(self._map, np.uint8, nbytes, at)
        if kind in _ELEMENT_DTYPES:
            data = raw.view(_ELEMENT_DTYPES[kind]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], dims[0] // block * block_bytes)
        return Tensor(name, kind, shape, data)
