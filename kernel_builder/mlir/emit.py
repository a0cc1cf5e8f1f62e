"""A small text emitter for MLIR-AIR modules: the one place that knows the syntax.

Builders describe a kernel (allocations, loops, DMAs, compute) through an `Emitter`; the emitter
owns SSA naming, constant placement and the generic-form spelling of every AIR op, so the
kernel modules read like the algorithm and a syntax fix happens once.

Conventions the rest of the pipeline relies on:
- AIR ops are written in MLIR's generic form, with *all* their attributes (including the
  inherent `operandSegmentSizes`, `sym_name`, `static_*` lists) in the attribute dictionary.
  A registered AIR dialect moves inherent attributes from that dictionary into the op's
  properties, so aircc reads them; and an MLIR parser without the AIR dialect keeps them as
  plain attributes, which is what lets `mlir_validate` inspect them.
- Every SSA name is unique in the module. Unregistered AIR regions are not name scopes for a
  parser that lacks the dialect, and unique names make the stitcher's renaming a pure map.
- Constants are hoisted to the top of the innermost isolated region (function or AIR
  hierarchy body) that uses them, so a constant is never referenced from outside its scope.
- DMA access patterns are spelled fully dynamic: index operands plus `static_*` lists of the
  dynamic marker. That is the one spelling both the older (operands only) and the newer
  (mixed static/dynamic) `air.dma_memcpy_nd` definitions accept with the same segment sizes.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, Union

from kernel_builder import externs, hw_rules

DYNAMIC = -(2 ** 63)  # ShapedType::kDynamic: marks an entry of a static_* list as an operand
L1 = externs.L1       # AIR memory spaces: L1 is a core's data memory, L2 the memory tiles;
L2 = 1                # L3 (DDR, the host's buffers) carries no memory space


@dataclass(frozen=True)
class Value:
    name: str
    type: str

    def __str__(self) -> str:
        return self.name


Index = Union[Value, int]
Pattern = tuple[Sequence[Index], Sequence[Index], Sequence[Index]]  # offsets, sizes, strides


def memref(shape: Sequence[int], dtype: str, space: int | None = None) -> str:
    """L1/L2 types are spelled exactly as the extern contract spells them, so calls type-check."""
    if space is not None:
        return externs.memref(tuple(shape), dtype, space)
    return f"memref<{'x'.join(str(d) for d in shape)}x{dtype}>"


_MEMREF = re.compile(r"memref<((?:\d+x)*)(\w+)(?:,\s*(\d+)\s*:\s*i32)?>")


def memref_parts(t: str) -> tuple[tuple[int, ...], str, int | None]:
    m = _MEMREF.fullmatch(t)
    if not m:
        raise ValueError(f"not a static memref type: {t}")
    dims = tuple(int(d) for d in m.group(1).split("x") if d)
    return dims, m.group(2), (int(m.group(3)) if m.group(3) else None)


def _fit_wraps(buf: Value, pattern: Pattern | None) -> Pattern | None:
    """A strided pattern whose contiguous innermost run is too long for the wrap of the DMA
    that serves `buf`'s memory (`hw_rules`) walks it as pieces that fit, one dimension more;
    a pattern that is one contiguous run is left alone (the DMA moves it in linear mode)."""
    if not pattern or len(pattern[1]) < 2:
        return pattern
    offsets, sizes, strides = (list(p) for p in pattern)
    n, step = sizes[-1], strides[-1]
    outer_sizes = [s for s in sizes[:-1] if s != 1]
    if not (isinstance(n, int) and step == 1) or not outer_sizes:
        return pattern
    if all(isinstance(v, int) for v in sizes + strides) and len(hw_rules.canonical(sizes, strides)) == 1:
        return pattern
    shape, dtype, space = memref_parts(buf.type)
    piece = hw_rules.split_long_run(space or 0, hw_rules.ITEMSIZE[dtype], n)
    if piece is None:
        return pattern
    return offsets[:-1] + [0, offsets[-1]], sizes[:-1] + [n // piece, piece], strides[:-1] + [piece, 1]


def float_literal(v: float) -> str:
    """MLIR float literals need a mantissa dot: `1e-05` is rejected, `1.000e-05` is not."""
    return f"{float(v):.9e}"


@dataclass
class _Scope:
    """An isolated-from-above region body: its own constants, emitted ahead of its ops."""

    indent: int
    consts: dict[tuple[str, str], Value] = field(default_factory=dict)
    const_lines: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Hierarchy:
    """Block arguments of an `air.launch` / `air.segment` / `air.herd` body."""

    ids: tuple[Value, ...]
    sizes: tuple[Value, ...]
    args: tuple[Value, ...]


class Emitter:
    def __init__(self) -> None:
        self._names: set[str] = set()
        self._symbols: set[str] = set()
        self._scopes: list[_Scope] = []
        self._depth = 0
        self._aliases: dict[str, str] = {}
        self._externs: dict[str, externs.ExternKernel] = {}
        self._herd_objects: list[set[str]] = []
        self._func: tuple[str, list[Value]] | None = None
        self._else_ok = False

    # ---- names -------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        base = re.sub(r"[^\w$.]", "_", hint) or "v"
        if base[0].isdigit():
            base = "v" + base
        name, n = base, 0
        while name in self._names:
            n += 1
            name = f"{base}_{n}"
        self._names.add(name)
        return "%" + name

    def symbol(self, hint: str) -> str:
        name, n = hint, 0
        while name in self._symbols:
            n += 1
            name = f"{hint}_{n}"
        self._symbols.add(name)
        return name

    def alias(self, affine_map: str) -> str:
        if affine_map not in self._aliases:
            n = len(self._aliases)
            self._aliases[affine_map] = "#map" if n == 0 else f"#map{n}"
        return self._aliases[affine_map]

    # ---- raw emission ------------------------------------------------------------------
    def emit(self, text: str) -> None:
        self._scopes[-1].lines.append("  " * self._depth + text)
        self._else_ok = False

    def _result(self, hint: str, type_: str, rhs: str) -> Value:
        v = Value(self.fresh(hint), type_)
        self.emit(f"{v} = {rhs}")
        return v

    # ---- constants and index arithmetic --------------------------------------------------
    def const(self, v: int | float, type_: str = "index") -> Value:
        scope = self._scopes[-1]
        literal = float_literal(v) if type_ in ("f32", "bf16") else str(int(v))
        key = (literal, type_)
        if key not in scope.consts:
            hint = f"c{int(v)}" if type_ == "index" else ("cst" if type_ != "i32" else f"c{int(v)}_i32")
            val = Value(self.fresh(hint.replace("-", "m")), type_)
            scope.consts[key] = val
            scope.const_lines.append("  " * scope.indent + f"{val} = arith.constant {literal} : {type_}")
        return scope.consts[key]

    def idx(self, v: Index) -> Value:
        return self.const(v) if isinstance(v, int) else v

    def _binop(self, op: str, a: Index, b: Index, fold: Callable[[int, int], int]) -> Index:
        if isinstance(a, int) and isinstance(b, int):
            return fold(a, b)
        return self._result("i", "index", f"arith.{op} {self.idx(a)}, {self.idx(b)} : index")

    def add(self, a: Index, b: Index) -> Index:
        if b == 0:
            return a
        if a == 0:
            return b
        return self._binop("addi", a, b, lambda x, y: x + y)

    def mul(self, a: Index, b: Index) -> Index:
        if b == 1:
            return a
        if a == 1:
            return b
        if a == 0 or b == 0:
            return 0
        return self._binop("muli", a, b, lambda x, y: x * y)

    def div(self, a: Index, b: int) -> Index:
        return a if b == 1 else self._binop("divui", a, b, lambda x, y: x // y)

    def rem(self, a: Index, b: int) -> Index:
        return 0 if b == 1 else self._binop("remui", a, b, lambda x, y: x % y)

    def min(self, a: Index, b: Index) -> Index:
        return self._binop("minui", a, b, min)

    def cmp(self, pred: str, a: Index, b: Index) -> Value:
        return self._result("p", "i1", f"arith.cmpi {pred}, {self.idx(a)}, {self.idx(b)} : index")

    def to_i32(self, a: Index) -> Value:
        if isinstance(a, int):
            return self.const(a, "i32")
        return self._result("pos", "i32", f"arith.index_cast {a} : index to i32")

    def to_index(self, a: Value) -> Value:
        return self._result("ix", "index", f"arith.index_cast {a} : {a.type} to index")

    # ---- memory ------------------------------------------------------------------------
    def alloc(self, shape: Sequence[int], dtype: str, space: int, hint: str) -> Value:
        t = memref(shape, dtype, space)
        return self._result(hint, t, f"memref.alloc() : {t}")

    def dealloc(self, *bufs: Value) -> None:
        for b in bufs:
            self.emit(f"memref.dealloc {b} : {b.type}")

    def load(self, buf: Value, indices: Sequence[Index], hint: str) -> Value:
        idx = ", ".join(str(self.idx(i)) for i in indices)
        return self._result(hint, memref_parts(buf.type)[1], f"memref.load {buf}[{idx}] : {buf.type}")

    def dma(self, dst: Value, dst_pattern: Pattern | None, src: Value, src_pattern: Pattern | None) -> None:
        """`air.dma_memcpy_nd`: copy `src[pattern]` into `dst[pattern]`; None is the whole buffer."""
        operands: list[Value] = []
        segments = [0]
        attrs = []
        for side, buf, pattern in (("dst", dst, dst_pattern), ("src", src, src_pattern)):
            pattern = _fit_wraps(buf, pattern)
            operands.append(buf)
            segments.append(1)
            lists = pattern or ((), (), ())
            if len(lists[1]) != len(lists[2]) or len(lists[0]) != len(lists[1]):
                raise ValueError(f"{side} access pattern needs equal-length offsets, sizes, strides")
            for kind, entries in zip(("offsets", "sizes", "strides"), lists):
                vals = [self.idx(e) for e in entries]
                operands += vals
                segments.append(len(vals))
                attrs.append(f"static_{side}_{kind} = {_i64_array([DYNAMIC] * len(vals))}")
        self.emit(
            f'"air.dma_memcpy_nd"({", ".join(map(str, operands))}) '
            f'{{{", ".join([_segments(segments)] + attrs)}}} '
            f': ({", ".join(v.type for v in operands)}) -> ()')

    # ---- compute -----------------------------------------------------------------------
    def fill(self, value: Value, buf: Value) -> None:
        self.emit(f"linalg.fill ins({value} : {value.type}) outs({buf} : {buf.type})")

    def generic(self, maps: Sequence[str], iterators: Sequence[str], ins: Sequence[Value],
                outs: Sequence[Value], body: Callable[[list[Value]], list[Value]]) -> None:
        """`linalg.generic` over memrefs; `body` maps the element block arguments to yields."""
        aliases = ", ".join(self.alias(m) for m in maps)
        its = ", ".join(f'"{i}"' for i in iterators)
        ins_s = f"ins({', '.join(map(str, ins))} : {', '.join(v.type for v in ins)}) " if ins else ""
        self.emit(f"linalg.generic {{indexing_maps = [{aliases}], iterator_types = [{its}]}} "
                  f"{ins_s}outs({', '.join(map(str, outs))} : {', '.join(v.type for v in outs)}) {{")
        args = [Value(self.fresh("in" if i < len(ins) else "out"), memref_parts(v.type)[1])
                for i, v in enumerate(list(ins) + list(outs))]
        self.emit("^bb0(" + ", ".join(f"{a}: {a.type}" for a in args) + "):")
        self._depth += 1
        results = body(args)
        self.emit(f"linalg.yield {', '.join(map(str, results))} : {', '.join(r.type for r in results)}")
        self._depth -= 1
        self.emit("}")

    def arith(self, op: str, *operands: Value, type_: str | None = None, hint: str = "t") -> Value:
        """Scalar float arithmetic on same-typed operands (`addf`, `mulf`, `divf`, ...)."""
        t = type_ or operands[0].type
        return self._result(hint, t, f"arith.{op} {', '.join(map(str, operands))} : {t}")

    def extf(self, v: Value, to: str = "f32") -> Value:
        return self._result("e", to, f"arith.extf {v} : {v.type} to {to}")

    def truncf(self, v: Value, to: str = "bf16") -> Value:
        return self._result("r", to, f"arith.truncf {v} : {v.type} to {to}")

    def rsqrt(self, v: Value) -> Value:
        return self._result("rs", v.type, f"math.rsqrt {v} : {v.type}")

    def call(self, kernel: externs.ExternKernel, *args: Value) -> None:
        """A call of an external kernel; the declaration comes from the extern contract only."""
        got = tuple(a.type for a in args)
        if got != kernel.arg_types:
            raise TypeError(f"call of @{kernel.symbol} with {got}, declared {kernel.arg_types}")
        self._externs.setdefault(kernel.symbol, kernel)
        if self._herd_objects:
            self._herd_objects[-1].add(kernel.link_object)
        self.emit(f"func.call @{kernel.symbol}({', '.join(map(str, args))}) : ({', '.join(got)}) -> ()")

    # ---- structured control flow ---------------------------------------------------------
    @contextmanager
    def loop(self, lb: Index, ub: Index, step: Index = 1, hint: str = "i") -> Iterator[Value]:
        iv = Value(self.fresh(hint), "index")
        self.emit(f"scf.for {iv} = {self.idx(lb)} to {self.idx(ub)} step {self.idx(step)} {{")
        self._depth += 1
        yield iv
        self._depth -= 1
        self.emit("}")

    @contextmanager
    def if_(self, cond: Value) -> Iterator[None]:
        self.emit(f"scf.if {cond} {{")
        self._depth += 1
        yield
        self._depth -= 1
        self.emit("}")
        self._else_ok = True

    @contextmanager
    def else_(self) -> Iterator[None]:
        """Opens the else branch of the `if_` block that was closed just before."""
        if not self._else_ok:
            raise RuntimeError("else_ must directly follow an if_ block")
        lines = self._scopes[-1].lines
        lines[-1] = lines[-1].rstrip() + " else {"
        self._depth += 1
        yield
        self._depth -= 1
        self.emit("}")

    # ---- AIR hierarchy -------------------------------------------------------------------
    @contextmanager
    def hierarchy(self, kind: str, sizes: Sequence[Index], operands: Sequence[Value],
                  hints: Sequence[str] = (), id_hints: Sequence[str] = ()) -> Iterator[Hierarchy]:
        """`air.launch` / `air.segment` / `air.herd` in generic form.

        Operands are (async deps = none, sizes, kernel operands); the body block takes the ids,
        then the sizes, then one argument per kernel operand, as the AIR ops define them.
        """
        size_vals = [self.idx(s) for s in sizes]
        n = len(size_vals)
        if not id_hints:
            id_hints = ["tx", "ty"][:n] if kind == "herd" else [f"{kind[0]}{i}" for i in range(n)]
        ids = tuple(Value(self.fresh(h), "index") for h in id_hints)
        szs = tuple(Value(self.fresh("s" + h), "index") for h in id_hints)
        hints = list(hints) + [f"a{i}" for i in range(len(hints), len(operands))]
        args = tuple(Value(self.fresh(h), v.type) for h, v in zip(hints, operands))
        block_args = ", ".join(f"{a}: {a.type}" for a in ids + szs + args)
        all_ops = list(size_vals) + list(operands)
        self.emit(f'"air.{kind}"({", ".join(map(str, all_ops))}) ({{')
        self.emit(f"^bb0({block_args}):" if block_args else "^bb0:")
        scope = _Scope(indent=self._depth + 1)
        parent, parent_depth = self._scopes[-1], self._depth
        self._scopes.append(scope)
        self._depth += 1
        if kind == "herd":
            self._herd_objects.append(set())
        yield Hierarchy(ids, szs, args)
        self.emit(f'"air.{kind}_terminator"() : () -> ()')
        self._scopes.pop()
        self._depth = parent_depth
        parent.lines += scope.const_lines + scope.lines
        attrs = [_segments([0, n, len(operands)]), f'sym_name = "{self.symbol(kind)}"']
        if kind == "herd":
            objects = self._herd_objects.pop()
            if len(objects) == 1:  # a herd can name one object; several are named by the declarations
                attrs.append(f'link_with = "{objects.pop()}"')
        types = ", ".join(v.type for v in all_ops)
        self.emit(f"}}) {{{', '.join(attrs)}}} : ({types}) -> ()")

    # ---- module ------------------------------------------------------------------------
    @contextmanager
    def function(self, name: str, arg_types: Sequence[str]) -> Iterator[list[Value]]:
        args = [Value(f"%arg{i}", t) for i, t in enumerate(arg_types)]
        self._names.update(a.name[1:] for a in args)
        self._scopes.append(_Scope(indent=2))
        self._depth = 2
        yield args
        self.emit("return")
        self._func = (name, args)

    def text(self) -> str:
        if self._func is None:
            raise RuntimeError("no function emitted")
        name, args = self._func
        scope = self._scopes[0]
        out = [f"{alias} = {m}" for m, alias in self._aliases.items()]
        out.append("module {")
        out.append(f"  func.func @{name}({', '.join(f'{a}: {a.type}' for a in args)}) {{")
        out += scope.const_lines + scope.lines
        out.append("  }")
        out += [f"  {k.declaration()}" for k in self._externs.values()]
        out.append("}")
        return "\n".join(out) + "\n"


def _segments(sizes: Sequence[int]) -> str:
    return f"operandSegmentSizes = array<i32: {', '.join(map(str, sizes))}>"


def _i64_array(vals: Sequence[int]) -> str:
    return f"array<i64: {', '.join(map(str, vals))}>" if vals else "array<i64>"
