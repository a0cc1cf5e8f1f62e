"""What a kernel group is: slots (name, shape, dtype, role) and launches (op, parameters, slots
read and written), and the group kinds.

The contract between build and run. `kernel_builder.groups` declares the groups of a model
with it; the MLIR builders, the stitcher, the KernelCache, the devices and the cost model read
the declarations through it. It sits below all of them, so a run-side module that only reads a
declaration never imports the builders.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any

import torch

from llama_base import q4nx


class Role(str, Enum):
    INPUT = "input"                # written by the host before every call
    STATIC = "static"              # weights / tables: written once per BO set
    INTERMEDIATE = "intermediate"  # written and read by launches only
    OUTPUT = "output"              # read back by the host after every call
    # Device-resident state (the KV cache of the resident designs): written and read by
    # launches across calls, of one group or of several sharing it (prefill appends, decode
    # appends and reads); zeros when allocated, and never written or read back by the host.
    STATE = "state"


DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32,
                                   q4nx.NAME: torch.uint8}


ITEMSIZE: dict[str, int] = {"bf16": 2, "f32": 4, "i32": 4}


# The element type of a slot's buffer as MLIR spells it: a quantized matrix is its bytes.
ELEMENT_TYPES: dict[str, str] = {"bf16": "bf16", "f32": "f32", "i32": "i32", q4nx.NAME: "i8"}


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role
    token_major: bool = False   # [seq, features] activation: rows past a prompt's length are padding
    # [kv_heads, ctx, head_dim] view of the KV cache: positions past those written so far hold
    # nothing, and no real row attends to them (causality), so the host does not read them.
    cache_positions: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def quantized(self) -> bool:
        return self.dtype == q4nx.NAME

    @property
    def nbytes(self) -> int:
        return q4nx.nbytes(*self.shape) if self.quantized else self.numel * ITEMSIZE[self.dtype]

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """The shape of the buffer's contents as `torch_dtype` elements: the declared shape, or
        the bytes of a quantized matrix."""
        return (self.nbytes,) if self.quantized else self.shape

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_type(self) -> str:
        """The MLIR element type of `storage_shape`: what the L3 memref and its DMAs move."""
        return ELEMENT_TYPES[self.dtype]


@dataclass(frozen=True)
class Launch:
    """One `air.launch`: an op applied to slots. Its kernel arguments are `reads + writes`, in order."""

    name: str
    op: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def args(self) -> tuple[str, ...]:
        return self.reads + self.writes

    def p(self, key: str) -> Any:
        for k, v in self.params:
            if k == key:
                return v
        raise KeyError(f"launch {self.name!r} has no parameter {key!r}")

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)


@dataclass(frozen=True)
class KernelGroup:
    kind: str                  # rms_gemms_rope, flash_attn, o_ffn, rms_gemv_rope, o_gemv_ffn, lm_head_gemv
    seq_len: int               # rows per call (1 for decode groups)
    slots: tuple[Slot, ...]
    launches: tuple[Launch, ...]
    options: tuple[tuple[str, Any], ...] = field(default=())
    ctx_len: int = 0           # attention only: positions of K/V it reads (>= seq_len); a resident group's window
    quant: str = "bf16"        # the format of its weight slots (QUANTS)
    wide: tuple[str, ...] = ()  # weight slots a quantized group holds in bf16 all the same (`build_group`)

    @cached_property
    def name(self) -> str:
        """Unique per compiled shape and weight format: prefill groups exist once per sequence
        bucket (and context), and a quantized kind once per set of weights it keeps in bf16.
        Kept once made (the fields are frozen): every device call asks for it."""
        fmt = "" if self.quant == "bf16" else f"_{self.quant}"
        if self.kind == FUSED_KIND:
            # Every layer's wide weights would make a name of hundreds of characters: a digest.
            fmt += f"_w{hashlib.sha256(','.join(self.wide).encode()).hexdigest()[:8]}" if self.wide else ""
            return f"{self.kind}_c{self.capacity}_w{self.ctx_len}{fmt}"
        fmt += "".join(f"_bf16_{w}" for w in self.wide)
        if self.kind not in PREFILL_KINDS:
            return self.kind + fmt
        ctx = f"_c{self.ctx_len}" if self.ctx_len and self.ctx_len != self.seq_len else ""
        resident = f"_resident{self.capacity}" if self.with_role(Role.STATE) else ""
        return f"{self.kind}_s{self.seq_len}{ctx}{resident}{fmt}"

    def slot(self, name: str) -> Slot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(f"group {self.name!r} has no slot {name!r}")

    def index(self, name: str) -> int:
        for i, s in enumerate(self.slots):
            if s.name == name:
                return i
        raise KeyError(f"group {self.name!r} has no slot {name!r}")

    @property
    def capacity(self) -> int:
        """Positions of the resident KV buffers a group reads (0 for a group without them);
        `ctx_len` is then the window of them it is compiled for."""
        states = self.with_role(Role.STATE)
        return states[0].shape[1] if states else 0

    def with_role(self, role: Role) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.role is role)

    @property
    def quantized(self) -> bool:
        """Whether any slot holds packed 4-bit weights (what a quantized format changes)."""
        return any(s.quantized for s in self.slots)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "seq_len": self.seq_len,
            "ctx_len": self.ctx_len,
            "slots": [[s.name, list(s.shape), s.dtype, s.role.value, s.token_major, s.cache_positions]
                      for s in self.slots],
            "launches": [
                {"name": l.name, "op": l.op, "reads": list(l.reads), "writes": list(l.writes),
                 "params": {k: v for k, v in l.params}}
                for l in self.launches
            ],
            "options": {k: v for k, v in self.options},
            "quant": self.quant,
            **({"wide": list(self.wide)} if self.wide else {}),
        }

    def fingerprint(self) -> str:
        blob = json.dumps(self.to_json(), sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()

    def validate(self) -> None:
        """Dataflow rules every consumer relies on; raises ValueError naming the broken rule."""
        names = [s.name for s in self.slots]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: duplicate slot names")
        written: set[str] = set()
        for l in self.launches:
            for r in l.reads:
                s = self.slot(r)
                if s.role in (Role.INTERMEDIATE, Role.OUTPUT) and r not in written:
                    raise ValueError(f"{self.name}: launch {l.name} reads {r} before any launch writes it")
            for w in l.writes:
                if self.slot(w).role in (Role.INPUT, Role.STATIC):
                    raise ValueError(f"{self.name}: launch {l.name} writes {self.slot(w).role.value} slot {w}")
                written.add(w)
        used = {a for l in self.launches for a in l.args}
        for s in self.slots:
            if s.name not in used:
                raise ValueError(f"{self.name}: slot {s.name} is used by no launch")
            if s.role in (Role.INTERMEDIATE, Role.OUTPUT) and s.name not in written:
                raise ValueError(f"{self.name}: {s.role.value} slot {s.name} is never written")
            if s.role is Role.STATE and not any(s.name in l.writes for l in self.launches):
                raise ValueError(f"{self.name}: state slot {s.name} is written by no launch: resident state "
                                 "fills in place, so a group that reads it appends too")
            if s.cache_positions and (s.role is not Role.INPUT or len(s.shape) != 3 or s.shape[1] != self.ctx_len):
                raise ValueError(f"{self.name}: cache slot {s.name} is not an input [heads, {self.ctx_len}, dim]")


PREFILL_KINDS = ("rms_gemms_rope", "flash_attn", "o_ffn")


# One call a token: every layer, the final norm and the LM head, the KV cache resident.
FUSED_KIND = "fused_decode"


def layer_slot(layer: int, name: str) -> str:
    """The name a group holding several layers gives layer `layer`'s slot `name`: a per-layer
    group's `name` in that layer's BO set (the KernelCache shares the buffer by it)."""
    return f"L{layer}_{name}"


def split_layer_slot(name: str) -> tuple[int, str] | None:
    """(layer, per-layer name) of a `layer_slot` name; None for a slot of no one layer."""
    m = re.fullmatch(r"L(\d+)_(.+)", name)
    return (int(m.group(1)), m.group(2)) if m else None


DECODE_KINDS = ("rms_gemv_rope", "o_gemv_ffn")


ALL_KINDS = PREFILL_KINDS + DECODE_KINDS + ("lm_head_gemv", FUSED_KIND)
