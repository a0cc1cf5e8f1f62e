"""What one stitched group module moves and computes, launch by launch, without running it.

The module is walked like the interpreter executes it (`npu_runtime.interp.program` records),
but no data moves and nothing is computed: each DMA adds its bytes to the level pair it
crosses, each `linalg.generic` and external call adds its work. A loop, launch grid or herd
whose body does the same work in every iteration is walked once and multiplied; the walk
iterates only where an induction variable or core index reaches a loop bound, an `scf.if`
condition or a DMA size (attention's causal tile ranges, its round-robin items). A loop whose
iterations differ only in which way their `scf.if`s go (decode attention's live and masked
chunks among a window's) is split into the classes of iterations that take the same branches,
found by evaluating the conditions' integer arithmetic for every iteration at once, and each
class is walked once and multiplied. So the count is exact and costs about as much as the
module has ops, even for a 2048-row prefill or a 131072-position window.

The only data the walk reads is i32 scalars (attention's `q_start`), which the caller passes.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields

import numpy as np

from npu_runtime.interp.program import CALL_OP, Block, MemRefType, Op, Program, load_program

L3, L2, L1 = 0, 1, 2
DYNAMIC = -(1 << 63)
ITEMSIZE = {"bf16": 2, "f32": 4, "i32": 4, "i8": 1}
# External kernels that contract (multiply-accumulate); every other extern is a vector pass
# over its largest buffer. The prefixes are the symbols `kernel_builder.externs` emits.
CONTRACTIONS = ("gemv_bf16_", "gemv_q4nx_", "attn_qk_", "attn_pv_")
# Contractions that add into f32 sums kept in L1 across calls (a GEMV whose K is split): besides
# the products, each call reads and rewrites those sums, elementwise work of their size, which
# grows as the K tile shrinks (more calls for the same products).
ACCUMULATING = ("gemv_bf16_acc_", "gemv_q4nx_")


@dataclass
class Work:
    """Counts for one region of execution. `core_*` follow the busiest core of each herd run
    (summed over runs): they bound the herd's compute time; the rest are totals."""

    l3_read: int = 0        # bytes L3 -> L2/L1 (shim MM2S side)
    l3_write: int = 0       # bytes L2/L1 -> L3
    l2_l1: int = 0          # bytes between a memory tile and cores, either way
    l3_dmas: int = 0        # DMA transfers that touch L3 (buffer descriptors the shim runs)
    l2_dmas: int = 0
    macs: int = 0
    vector: int = 0         # elementwise element-operations (linalg without a contraction, vector externs)
    core_macs: int = 0
    core_vector: int = 0
    core_dma_bytes: int = 0  # bytes in and out of the busiest core's L1
    cores: int = 0          # largest herd seen
    columns: int = 0        # array columns of that herd

    def add(self, other: "Work", times: int = 1) -> None:
        for f in fields(self):
            if f.name in ("cores", "columns"):
                setattr(self, f.name, max(getattr(self, f.name), getattr(other, f.name)))
            else:
                setattr(self, f.name, getattr(self, f.name) + times * getattr(other, f.name))


@dataclass
class LaunchCounts:
    name: str
    work: Work = field(default_factory=Work)


@dataclass
class _Buf:
    type: MemRefType
    data: np.ndarray | None = None     # only i32 buffers carry values

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.type.dtype]


def _variant(block: Block, seeds: set[int]) -> bool:
    """True if a value derived from `seeds` reaches a loop bound, an `scf.if` condition, a DMA
    size or a hierarchy size inside `block`: then iterations differ in the work they do."""
    tainted = set(seeds)

    def visit(b: Block) -> bool:
        for op in b.ops:
            hit = any(o in tainted for o in op.operands)
            if op.name == "scf.for" and any(o in tainted for o in op.operands[:3]):
                return True
            if op.name == "scf.if" and hit:
                return True
            if op.name == "air.dma_memcpy_nd":
                segs = op.segments()
                if any(o in tainted for s in (segs[3], segs[7]) for o in s):
                    return True
            if op.name in ("air.launch", "air.segment", "air.herd"):
                _, sizes, operands = op.segments()
                if any(o in tainted for o in sizes):
                    return True
                body = op.regions[0]
                n_ids = len(sizes)
                for arg, o in zip(body.args[2 * n_ids:], operands):
                    if o in tainted:
                        tainted.add(arg)
            if hit:
                tainted.update(op.results)
            for r in op.regions:
                if visit(r):
                    return True
        return False

    return visit(block)


def _branch_conditions(block: Block, seeds: set[int]) -> list[int] | None:
    """The `scf.if` conditions of `block` that values derived from `seeds` reach, when that is the
    only way those values make its iterations differ (none reaches a loop bound, a DMA size, a
    hierarchy size, or a condition inside a nested loop or hierarchy); None when another is."""
    tainted = set(seeds)
    conds: list[int] = []

    def visit(b: Block) -> bool:
        for op in b.ops:
            hit = any(o in tainted for o in op.operands)
            if op.name == "scf.for":
                if any(o in tainted for o in op.operands[:3]) or (hit and _variant(op.regions[0], tainted)):
                    return False
            elif op.name in ("air.launch", "air.segment", "air.herd"):
                _, sizes, operands = op.segments()
                body = op.regions[0]
                inner = tainted | {a for a, o in zip(body.args[2 * len(sizes):], operands) if o in tainted}
                if any(o in tainted for o in sizes) or (hit and _variant(body, inner)):
                    return False
            else:
                if op.name == "scf.if" and hit:
                    conds.append(op.operands[0])
                if op.name == "air.dma_memcpy_nd":
                    segs = op.segments()
                    if any(o in tainted for s in (segs[3], segs[7]) for o in s):
                        return False
                if any(not visit(r) for r in op.regions):
                    return False
            if hit:
                tainted.update(op.results)
        return True

    return conds if visit(block) else None


# `_INT_OPS` over arrays of every iteration's values
_VECTOR_INT_OPS = {"arith.addi": np.add, "arith.muli": np.multiply, "arith.divui": np.floor_divide,
                   "arith.remui": np.remainder, "arith.minui": np.minimum}


def _branch_classes(body: Block, conds: list[int], env: dict, ivs: np.ndarray) -> list[tuple[int, int]] | None:
    """(a representative induction value, how many iterations) for each set of branches the
    iterations `ivs` of `body` take; None when a condition needs a value the walk cannot know
    without walking (anything but integer arithmetic on the induction variable and known values)."""
    local: dict[int, object] = {body.args[0]: ivs}
    unknown = object()

    def value(v):
        return local[v] if v in local else env.get(v)

    def visit(b: Block) -> None:
        for op in b.ops:
            args = [value(o) for o in op.operands]
            known = all(a is not None and a is not unknown for a in args)
            if op.name == "arith.constant":
                v = op.attrs["value"]
                local[op.results[0]] = int(v) if op.types[0] in ("index", "i32", "i64") else unknown
            elif op.name in _VECTOR_INT_OPS and known:
                local[op.results[0]] = _VECTOR_INT_OPS[op.name](*args)
            elif op.name == "arith.index_cast" and known:
                local[op.results[0]] = args[0]
            elif op.name == "arith.cmpi" and known:
                local[op.results[0]] = _CMP[op.attrs["predicate"]](*args)
            elif op.name == "scf.if":
                for r in op.regions:
                    visit(r)
            else:       # values of any other op (or of unknown operands) are not followed
                for r in op.results:
                    local[r] = unknown

    visit(body)
    outcomes = [value(c) for c in conds]
    if any(o is None or o is unknown for o in outcomes):
        return None
    table = np.stack([np.broadcast_to(np.asarray(o, bool), ivs.shape) for o in outcomes], axis=1)
    _, first, counts = np.unique(table, axis=0, return_index=True, return_counts=True)
    return [(int(ivs[i]), int(n)) for i, n in zip(first, counts)]


class Counter:
    """`shortcut=False` walks every iteration of a loop whose iterations differ only in their
    branches (the slow walk the classes are held to)."""

    def __init__(self, program: Program, scalars: dict[int, int] | None = None, shortcut: bool = True):
        self.p = program
        self.scalars = scalars or {}
        self.shortcut = shortcut
        self._variant: dict[int, bool] = {}
        self._conds: dict[int, list[int] | None] = {}

    def run(self) -> list[LaunchCounts]:
        env: dict[int, object] = {}
        for i, (vid, t) in enumerate(zip(self.p.args, self.p.arg_types)):
            data = None
            if t.dtype == "i32":
                data = np.full(math.prod(t.shape), self.scalars.get(i, 0), np.int64)
            env[vid] = _Buf(t, data)
        out = []
        for op in self.p.body.ops:
            w = Work()
            self._op(op, env, w)
            if op.name == "air.launch":
                out.append(LaunchCounts(str(op.attrs.get("sym_name", f"launch{len(out)}")), w))
        return out

    def _is_variant(self, op: Op, seeds: list[int]) -> bool:
        key = id(op)
        if key not in self._variant:
            self._variant[key] = _variant(op.regions[0], set(seeds))
        return self._variant[key]

    def block(self, block: Block, env: dict, w: Work) -> None:
        for op in block.ops:
            self._op(op, env, w)

    def _op(self, op: Op, env: dict, w: Work) -> None:
        name = op.name
        if name == "arith.constant":
            v = op.attrs["value"]
            env[op.results[0]] = int(v) if op.types[0] in ("index", "i32", "i64") else v
        elif name in _INT_OPS:
            a, b = (env.get(o) for o in op.operands)
            env[op.results[0]] = _INT_OPS[name](a, b) if isinstance(a, int) and isinstance(b, int) else None
        elif name == "arith.index_cast":
            env[op.results[0]] = env.get(op.operands[0])
        elif name == "arith.cmpi":
            a, b = (env.get(o) for o in op.operands)
            env[op.results[0]] = _CMP[op.attrs["predicate"]](a, b)
        elif name == "memref.alloc":
            t = MemRefType.parse(op.types[0])
            env[op.results[0]] = _Buf(t, np.zeros(math.prod(t.shape), np.int64) if t.dtype == "i32" else None)
        elif name == "memref.load":
            buf, *idx = (env.get(o) for o in op.operands)
            env[op.results[0]] = (int(buf.data[np.ravel_multi_index(tuple(idx), buf.type.shape)])
                                  if buf.data is not None else None)
        elif name == "air.dma_memcpy_nd":
            self._dma(op, env, w)
        elif name == "linalg.generic":
            self._generic(op, env, w)
        elif name == CALL_OP:
            self._call(op, w)
        elif name == "scf.for":
            self._for(op, env, w)
        elif name == "scf.if":
            if env.get(op.operands[0]):
                self.block(op.regions[0], env, w)
            elif len(op.regions) > 1:
                self.block(op.regions[1], env, w)
        elif name in ("air.launch", "air.segment", "air.herd"):
            self._hierarchy(op, env, w)
        # everything else (float scalars, fills, deallocs, terminators) neither moves nor contracts

    def _for(self, op: Op, env: dict, w: Work) -> None:
        lb, ub, step = (env.get(o) for o in op.operands[:3])
        trips = len(range(lb, ub, step))
        body = op.regions[0]
        if trips == 0:
            return
        if not self._is_variant(op, [body.args[0]]):
            env[body.args[0]] = lb
            sub = Work()
            self.block(body, env, sub)
            w.add(sub, trips)
            return
        if self.shortcut:
            key = id(op)
            if key not in self._conds:
                self._conds[key] = _branch_conditions(body, {body.args[0]})
            conds = self._conds[key]
            classes = (_branch_classes(body, conds, env, np.arange(lb, ub, step, dtype=np.int64))
                       if conds is not None else None)
            if classes is not None:
                for iv, n in classes:
                    env[body.args[0]] = iv
                    sub = Work()
                    self.block(body, env, sub)
                    w.add(sub, n)
                return
        for iv in range(lb, ub, step):
            env[body.args[0]] = iv
            self.block(body, env, w)

    def _hierarchy(self, op: Op, env: dict, w: Work) -> None:
        _, sizes_v, operands = op.segments()
        sizes = [env.get(s) for s in sizes_v]
        body = op.regions[0]
        n = len(sizes)
        for arg, o in zip(body.args[2 * n:], operands):
            env[arg] = env.get(o)
        for arg, s in zip(body.args[n:2 * n], sizes):
            env[arg] = s
        points = list(itertools.product(*(range(s) for s in sizes)))
        uniform = not self._is_variant(op, body.args[:n])
        runs = [Work() for _ in (points[:1] if uniform else points)]
        for ids, sub in zip(points, runs):
            for arg, i in zip(body.args[:n], ids):
                env[arg] = i
            self.block(body, env, sub)
        total = Work()
        for sub in runs:
            total.add(sub, len(points) if uniform else 1)
        if op.name == "air.herd":
            busiest = max(runs, key=lambda r: (r.core_macs, r.core_vector))
            total.core_macs, total.core_vector = busiest.core_macs, busiest.core_vector
            total.core_dma_bytes = max(r.core_dma_bytes for r in runs)
            total.cores, total.columns = len(points), sizes[0]
        w.add(total)

    def _dma(self, op: Op, env: dict, w: Work) -> None:
        _, dst, _, d_size, _, src, _, s_size, _ = op.segments()
        dbuf, sbuf = env[dst[0]], env[src[0]]
        a = op.attrs
        sizes = _pattern(a["static_dst_sizes"], d_size, env) or _pattern(a["static_src_sizes"], s_size, env)
        n = math.prod(sizes) if sizes else math.prod(dbuf.type.shape)
        nbytes = n * dbuf.itemsize
        spaces = {dbuf.type.space, sbuf.type.space}
        if L3 in spaces:
            w.l3_dmas += 1
            if sbuf.type.space == L3:
                w.l3_read += nbytes
            else:
                w.l3_write += nbytes
        else:
            w.l2_dmas += 1
            w.l2_l1 += nbytes
        if L1 in spaces:
            w.core_dma_bytes += nbytes
        if dbuf.data is not None and sbuf.data is not None and not sizes:
            dbuf.data[:] = sbuf.data        # the only values the walk needs: whole i32 scalars

    def _generic(self, op: Op, env: dict, w: Work) -> None:
        maps = op.attrs["indexing_maps"]
        sizes = [0] * maps[0][0]
        for (_, results), vid in zip(maps, op.operands):
            shape = env[vid].type.shape
            for pos, r in enumerate(results):
                if isinstance(r, int):
                    sizes[r] = shape[pos]
        points = math.prod(sizes)
        contraction = "reduction" in op.attrs["iterator_types"] and any(
            o.name == "arith.mulf" for o in op.regions[0].ops)
        if contraction:
            w.macs += points
            w.core_macs += points
        else:
            w.vector += points
            w.core_vector += points

    def _call(self, op: Op, w: Work) -> None:
        symbol = op.attrs["callee"]
        types = [MemRefType.parse(t) for t in self.p.externs.get(symbol, ()) if t.startswith("memref")]
        shapes = [t.shape for t in types]
        if symbol.startswith(CONTRACTIONS) and len(shapes) >= 2:
            # Both operand tiles share the contracted dimension: rows(a) x rows(b) x shared, or a
            # matrix times a vector (the GEMVs), whose product is the matrix's size.
            a, b = shapes[0], shapes[1]
            macs = math.prod(a) if len(b) == 1 else a[0] * math.prod(b)
            w.macs += macs
            w.core_macs += macs
            if symbol.startswith(ACCUMULATING):
                sums = sum(math.prod(t.shape) for t in types if t.dtype == "f32")
                w.vector += sums
                w.core_vector += sums
        else:
            n = max((math.prod(s) for s in shapes), default=0)
            w.vector += n
            w.core_vector += n


def _pattern(static: list[int], dyn: list[int], env: dict) -> list[int]:
    it = iter(dyn)
    return [env.get(next(it)) if s == DYNAMIC else s for s in static]


_INT_OPS = {"arith.addi": lambda a, b: a + b, "arith.muli": lambda a, b: a * b,
            "arith.divui": lambda a, b: a // b, "arith.remui": lambda a, b: a % b, "arith.minui": min}
_CMP = {0: lambda a, b: a == b, 1: lambda a, b: a != b, 2: lambda a, b: a < b, 3: lambda a, b: a <= b,
        4: lambda a, b: a > b, 5: lambda a, b: a >= b, 6: lambda a, b: a < b, 7: lambda a, b: a <= b,
        8: lambda a, b: a > b, 9: lambda a, b: a >= b}


def count_module(text: str, scalars: dict[int, int] | None = None, shortcut: bool = True) -> list[LaunchCounts]:
    """Per top-level launch of a stitched module: its `Work`. `scalars` gives the value of i32
    function arguments by index (attention's `q_start`, decode's `pos`; 0 if not given).
    `shortcut=False`: every iteration of a loop that differs only in its branches walked (`Counter`)."""
    return Counter(load_program(text), scalars, shortcut).run()


__all__ = ["ACCUMULATING", "CONTRACTIONS", "Counter", "LaunchCounts", "Work", "count_module"]
