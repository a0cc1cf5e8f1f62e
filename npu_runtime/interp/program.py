"""A stitched group module as plain Python data: ops, value numbers, attributes, regions.

The module is parsed once with IREE's MLIR bindings (the parser `multi_launch_builder`
already validates with, so the interpreter reads exactly the structure the validator
checked), then copied into `Op` records that number every SSA value. Execution never touches
the bindings again: an environment is a list indexed by those numbers, which keeps each op's
dispatch a few list lookups.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from iree.compiler import ir

from multi_launch_builder.mlir_validate import CALL_OP, rewrite_calls

_MEMREF = re.compile(r"memref<((?:\d+x)*)(\w+)(?:,\s*(\d+)\s*:\s*i32)?>")
_MAP = re.compile(r"affine_map<\(([^)]*)\)\s*->\s*\(([^)]*)\)>")


@dataclass(frozen=True)
class MemRefType:
    shape: tuple[int, ...]
    dtype: str              # bf16, f32, i32, i8
    space: int              # 0 = L3 (a function argument), 1 = L2, 2 = L1

    @classmethod
    def parse(cls, text: str) -> "MemRefType":
        m = _MEMREF.fullmatch(text.strip())
        if not m:
            raise ValueError(f"not a memref type: {text}")
        dims = tuple(int(d) for d in m.group(1).rstrip("x").split("x")) if m.group(1) else ()
        return cls(dims, m.group(2), int(m.group(3) or 0))


@dataclass
class Block:
    args: list[int]
    ops: list["Op"]


@dataclass
class Op:
    name: str
    operands: list[int]
    results: list[int]
    attrs: dict[str, object]
    regions: list[Block] = field(default_factory=list)
    types: list[str] = field(default_factory=list)   # result types (memref allocations need theirs)

    def segments(self) -> list[list[int]]:
        """Operands split by `operandSegmentSizes`."""
        out, i = [], 0
        for n in self.attrs["operandSegmentSizes"]:
            out.append(self.operands[i:i + n])
            i += n
        return out


@dataclass
class Program:
    name: str
    args: list[int]
    arg_types: list[MemRefType]
    body: Block
    externs: dict[str, tuple[str, ...]]      # symbol -> MLIR argument types
    n_values: int


def parse_affine_map(text: str) -> tuple[int, list[int | str]]:
    """(number of dims, results): a result is a dim position, or the constant as text ('0')."""
    m = _MAP.fullmatch(text.strip())
    if not m:
        raise ValueError(f"unsupported affine map {text}")
    dims = [d.strip() for d in m.group(1).split(",") if d.strip()]
    results: list[int | str] = []
    for r in (x.strip() for x in m.group(2).split(",") if x.strip()):
        results.append(dims.index(r) if r in dims else r)
    return len(dims), results


def _attr(name: str, a) -> object:
    if name in ("operandSegmentSizes",):
        return list(ir.DenseI32ArrayAttr(a))
    if name.startswith("static_"):
        return list(ir.DenseI64ArrayAttr(a))
    if name == "indexing_maps":
        return [parse_affine_map(str(x)) for x in ir.ArrayAttr(a)]
    if name == "iterator_types":
        return [str(x).split("<")[-1].rstrip(">").strip('"') for x in ir.ArrayAttr(a)]
    if name == "value":
        return ir.FloatAttr(a).value if isinstance(a, ir.FloatAttr) else ir.IntegerAttr(a).value
    if name == "predicate":
        return ir.IntegerAttr(a).value
    if name == "callee":
        return str(a).lstrip("@")
    if name in ("sym_name", "link_with"):
        return ir.StringAttr(a).value
    return str(a)


class _Numbering:
    def __init__(self):
        self.ids: dict = {}

    def __call__(self, value) -> int:
        return self.ids.setdefault(value, len(self.ids))


def _convert_block(block, num: _Numbering) -> Block:
    args = [num(a) for a in block.arguments]
    ops = []
    for o in block.operations:
        o = o.operation
        names = [n if isinstance(n, str) else n.name for n in o.attributes]
        ops.append(Op(
            o.name, [num(v) for v in o.operands], [num(r) for r in o.results],
            {n: _attr(n, o.attributes[n]) for n in names},
            [_convert_block(b, num) for r in o.regions for b in r.blocks],
            [str(r.type) for r in o.results],
        ))
    return Block(args, ops)


def load_program(text: str) -> Program:
    """The group module's one public function and its external declarations."""
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(rewrite_calls(text))
        num = _Numbering()
        func = None
        externs: dict[str, tuple[str, ...]] = {}
        for o in module.body.operations:
            o = o.operation
            if o.name != "func.func":
                continue
            sym = ir.StringAttr(o.attributes["sym_name"]).value
            ftype = ir.FunctionType(ir.TypeAttr(o.attributes["function_type"]).value)
            if "sym_visibility" in [n if isinstance(n, str) else n.name for n in o.attributes]:
                externs[sym] = tuple(str(t) for t in ftype.inputs)
            else:
                func = (sym, [str(t) for t in ftype.inputs], _convert_block(o.regions[0].blocks[0], num))
    if func is None:
        raise ValueError("the module defines no public function")
    name, arg_types, body = func
    return Program(name, body.args, [MemRefType.parse(t) for t in arg_types], body, externs, len(num.ids))


__all__ = ["Block", "CALL_OP", "MemRefType", "Op", "Program", "load_program", "parse_affine_map"]
