"""The hardware rules (`hw_rules`) applied to a parsed module without running it.

Every index value gets what is known of it for every iteration: its exact value when it is
a constant or folds from constants, else a known divisor (loop counters: a divisor of both
bound and step; products multiply divisors, sums and remainders take their gcd; herd ids
none). Sizes and strides must be exact; an offset is checked through its divisor, so a
word-aligned verdict holds for every iteration. Memory is counted per herd core (its L1
allocations) and per segment (its L2 allocations), a buffer that a DMA fills or drains
inside a loop counted twice (the compiler ping-pongs it); descriptors are counted per core
and per segment's memory tile, one per DMA op: a lower bound, since the compiler may give an
op more (a ping-ponged buffer's second descriptor, an unrolled loop's iterations). Locks are
counted in the same places, a pair per buffer the tile's DMAs move (on a core, per direction;
a ping-ponged buffer's halves share theirs).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from iree.compiler import ir

from kernel_builder.mlir.emit import DYNAMIC, memref_parts
from kernel_builder import hw_rules as hw

_FOLD = {"arith.addi": lambda a, b: a + b, "arith.subi": lambda a, b: a - b, "arith.muli": lambda a, b: a * b,
         "arith.divui": lambda a, b: a // b, "arith.remui": lambda a, b: a % b, "arith.minui": min}


def location(op) -> str:
    m = re.search(r":(\d+):(\d+)", str(op.location))
    return f"line {m.group(1)}" if m else "?"


def _memref(v) -> tuple[int, int, int] | None:
    """(space, itemsize, bytes) of a memref value."""
    try:
        shape, dtype, space = memref_parts(str(v.type))
    except ValueError:
        return None
    return space or 0, hw.ITEMSIZE[dtype], math.prod(shape) * hw.ITEMSIZE[dtype]


@dataclass
class _Scope:
    """One hierarchy body: what it allocates and which of its buffers a DMA moves in a loop."""

    kind: str
    name: str
    allocs: list = field(default_factory=list)          # (value, bytes, space)
    looped: set = field(default_factory=set)            # buffers a DMA moves inside a loop
    locked: set = field(default_factory=set)            # what needs a pair of locks (`hw.lock_problem`)
    bds: int = 0


class StaticRules:
    def __init__(self):
        self.const: dict = {}
        self.div: dict = {}
        self.root: dict = {}        # hierarchy block argument -> the value passed in from outside
        self.problems: list[str] = []
        self.where = {"launch": "-", "herd": "-"}

    def report(self, op, msg: str) -> None:
        self.problems.append(f"launch {self.where['launch']}, herd {self.where['herd']}, {op.name} "
                             f"({location(op)}): {msg}")

    def divisor(self, v) -> int:
        if v in self.const:
            return abs(self.const[v])
        return self.div.get(v, 1)

    def run(self, func_body) -> list[str]:
        self._block(func_body, [], False)
        return self.problems

    def _block(self, block, scopes: list[_Scope], in_loop: bool) -> None:
        for op in block.operations:
            self._op(op.operation, scopes, in_loop)

    def _op(self, op, scopes: list[_Scope], in_loop: bool) -> None:
        name = op.name
        res = list(op.results)
        ins = list(op.operands)
        if name == "arith.constant" and res and isinstance(res[0].type, (ir.IndexType, ir.IntegerType)):
            self.const[res[0]] = ir.IntegerAttr(op.attributes["value"]).value
        elif name in _FOLD and all(v in self.const for v in ins):
            if not (name in ("arith.divui", "arith.remui") and self.const[ins[1]] == 0):
                self.const[res[0]] = _FOLD[name](*(self.const[v] for v in ins))
        elif name == "arith.muli":
            self.div[res[0]] = self.divisor(ins[0]) * self.divisor(ins[1])
        elif name in ("arith.addi", "arith.subi", "arith.remui", "arith.minui"):
            self.div[res[0]] = math.gcd(self.divisor(ins[0]), self.divisor(ins[1]))
        elif name == "arith.index_cast":
            if ins[0] in self.const:
                self.const[res[0]] = self.const[ins[0]]
            else:
                self.div[res[0]] = self.divisor(ins[0])
        elif name == "memref.alloc" and scopes:
            info = _memref(res[0])
            if info:
                scopes[-1].allocs.append((res[0], info[2], info[0]))
        elif name == "scf.for":
            body = op.regions[0].blocks[0]
            self.div[body.arguments[0]] = math.gcd(self.divisor(ins[0]), self.divisor(ins[2]))
            self._block(body, scopes, True)
            return
        elif name in ("air.launch", "air.segment", "air.herd"):
            self._hierarchy(op, scopes)
            return
        elif name == "air.dma_memcpy_nd":
            self._dma(op, scopes, in_loop)
        for region in op.regions:
            for b in region.blocks:
                self._block(b, scopes, in_loop)

    def _hierarchy(self, op, scopes: list[_Scope]) -> None:
        segs = _segments(op)
        ins = list(op.operands)
        sizes = ins[segs[0]:segs[0] + segs[1]]
        operands = ins[segs[0] + segs[1]:]
        body = op.regions[0].blocks[0]
        args = list(body.arguments)
        for a, s in zip(args[segs[1]:2 * segs[1]], sizes):
            if s in self.const:
                self.const[a] = self.const[s]
        for a, v in zip(args[2 * segs[1]:], operands):
            self.root[a] = self.root.get(v, v)
            if v in self.const:
                self.const[a] = self.const[v]
            else:
                self.div[a] = self.divisor(v)
        kind = op.name.split(".")[1]
        sym = op.attributes["sym_name"] if "sym_name" in op.attributes else None
        label = ir.StringAttr(sym).value if sym is not None else "?"
        saved = dict(self.where)
        if kind in self.where:
            self.where[kind] = label
        if kind == "herd":
            known = [self.const.get(s) for s in sizes]
            problem = hw.herd_problem([k if k is not None else 0 for k in known])
            if problem:
                self.report(op, problem)
        scope = _Scope(kind, label)
        self._block(body, scopes + [scope], False)
        self._close(op, scope)
        self.where = saved

    def _close(self, op, scope: _Scope) -> None:
        """Budgets of a finished hierarchy body: L1 per herd core, L2 and memory-tile
        descriptors per segment, descriptors per core."""
        def held(space: int) -> int:
            return sum(n * (hw.DOUBLE_BUFFER if v in scope.looped else 1)
                       for v, n, s in scope.allocs if s == space)
        if scope.kind == "herd":
            problems = (hw.l1_problem(held(hw.L1)), hw.bd_problem(scope.bds, hw.CORE, "each core"),
                        hw.lock_problem(len(scope.locked), hw.CORE, "each core"))
        elif scope.kind == "segment":
            problems = (hw.l2_problem(held(hw.L2)), hw.bd_problem(scope.bds, hw.MEMTILE, "the memory tile"),
                        hw.lock_problem(len(scope.locked), hw.MEMTILE, "the memory tile"))
        else:
            problems = ()
        for problem in problems:
            if problem:
                self.report(op, problem)

    def _dma(self, op, scopes: list[_Scope], in_loop: bool) -> None:
        segs = _segments(op)
        ins = list(op.operands)
        pos = [sum(segs[:i]) for i in range(len(segs))]
        for side, at in (("dst", 1), ("src", 5)):
            buf = ins[pos[at]]
            info = _memref(buf)
            if info is None:
                continue
            space, item, nbytes = info
            parts = []
            for k, kind in enumerate(("offsets", "sizes", "strides")):
                dyn = iter(ins[pos[at + 1 + k]:pos[at + 1 + k] + segs[at + 1 + k]])
                static = op.attributes[f"static_{side}_{kind}"] if f"static_{side}_{kind}" in op.attributes else None
                entries = list(ir.DenseI64ArrayAttr(static)) if static is not None else [DYNAMIC] * segs[at + 1 + k]
                parts.append([next(dyn) if e == DYNAMIC else e for e in entries])
            offs, sizes, strides = parts
            exact = lambda v: v if isinstance(v, int) else self.const.get(v)   # noqa: E731
            sizes_v = [exact(v) for v in sizes]
            strides_v = [exact(v) for v in strides]
            divs = [(o if isinstance(o, int) else self.divisor(o)) * (s or 0) * item for o, s in zip(offs, strides_v)]
            for problem in hw.dma_side_problems(space, item, hw.gcd_all(divs), sizes_v, strides_v, nbytes,
                                                 offset_exact=False):
                self.report(op, f"{'destination' if side == 'dst' else 'source'} ({hw.ENGINE[space].tile}): {problem}")
            # Descriptors and double buffers belong to the hierarchy body that owns the buffer's tile.
            owner = next((s for s in reversed(scopes) if s.kind == {hw.L1: "herd", hw.L2: "segment"}.get(space)), None)
            if owner is not None:
                root = self.root.get(buf, buf)
                owner.bds += 1
                owner.locked.add((root, side) if space == hw.L1 else root)
                if in_loop:
                    owner.looped.add(root)


def _segments(op) -> list[int]:
    return list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))


def check_function(func_op) -> list[str]:
    """Every rule broken in the module's public function, each naming launch, herd and op."""
    return StaticRules().run(func_op.regions[0].blocks[0])
