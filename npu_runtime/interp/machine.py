"""Executes a group's MLIR-AIR program on numpy buffers, checking what the NPU would not.

The hierarchy runs as written: every iteration of a launch grid, every segment, every core of
a herd (one after another; each core's L1 allocations are its own). DMAs follow their N-d
offsets / sizes / strides exactly, arithmetic and linalg ops run with numpy over whole
buffers, and external kernels run from their C++ sources' host builds (`HostKernels`).

While it runs it checks, and stops at the first failure with an `InterpError` naming the
group, launch, herd core and op:
- a DMA that reads or writes outside either memref, or breaks a rule of the DMA serving its
  side (`kernel_builder.hw_rules`: whole 32-bit words at word-aligned offsets, the tile kind's
  dimensions, wraps, strides and transfer length), checked with that iteration's values;
- a read of L1/L2 bytes nobody wrote since allocation (DMA source, linalg input, load, or a
  kernel argument the kernel reads);
- two cores of one herd writing the same element of a shared buffer, or a core reading an
  element another core of the same herd wrote (the cores run concurrently on the NPU, so the
  result would depend on timing);
- per-core live L1 bytes above `L1_BUDGET`, per-segment live L2 bytes above one memory tile
  (a buffer a DMA moves inside a loop counts twice from then on: the compiler ping-pongs it),
  an L2 allocation inside a herd (a core allocates only its own L1), a herd larger than the
  array (`hw_rules`);
- a launch that writes an L3 buffer it does not declare, or leaves part of one it declares
  unwritten, when the caller says which buffers each launch writes (the group declaration does);
  a buffer the caller names as written in part (device-resident state, which a launch appends
  to) is exempt from the second check only.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from kernel_builder import hw_rules
from npu_runtime.api import DeviceError
from npu_runtime.interp.linalg import generic
from npu_runtime.interp.program import CALL_OP, Block, MemRefType, Op, Program

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32), "i32": np.dtype(np.int32),
          "i8": np.dtype(np.uint8)}      # bytes (a Q4NX matrix): unsigned, as the kernels read them
DYNAMIC = -(1 << 63)       # marks a dynamic entry in a DMA's static_* list
L1, L2, L3 = 2, 1, 0
_CMP = {0: lambda a, b: a == b, 1: lambda a, b: a != b, 2: lambda a, b: a < b, 3: lambda a, b: a <= b,
        4: lambda a, b: a > b, 5: lambda a, b: a >= b, 6: lambda a, b: a < b, 7: lambda a, b: a <= b,
        8: lambda a, b: a > b, 9: lambda a, b: a >= b}


class InterpError(DeviceError):
    """The module did something the NPU would get wrong, or that the interpreter cannot run."""


@dataclass
class Buffer:
    data: np.ndarray                 # flat
    shape: tuple[int, ...]
    space: int
    name: str
    written: np.ndarray | None       # per element, for L1/L2: what has been written since allocation
    doubled: bool = False            # a DMA moved it inside a loop: the compiler keeps two of it

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass
class ExternCall:
    """How to run one external kernel: the host function and which memref arguments it reads / writes."""

    fn: Callable[..., None]
    reads: tuple[int, ...]
    writes: tuple[int, ...]


class Machine:
    def __init__(self, program: Program, group: str, externs: dict[str, ExternCall],
                 launch_writes: list[tuple[int, ...]] | None = None, arg_names: list[str] | None = None,
                 partial_writes: frozenset[int] = frozenset()):
        """`partial_writes`: arguments a launch that declares them may leave partly unwritten
        (the group's `STATE` slots: a KV append writes its rows and keeps every other position)."""
        self.p = program
        self.group = group
        self.arg_names = arg_names
        self.externs = externs
        self.launch_writes = launch_writes
        self.partial_writes = frozenset(partial_writes)
        self._reset()
        self.ops = {
            "arith.constant": self._constant, "arith.addi": _binop(lambda a, b: a + b),
            "arith.subi": _binop(lambda a, b: a - b),
            "arith.muli": _binop(lambda a, b: a * b), "arith.divui": _binop(lambda a, b: a // b),
            "arith.remui": _binop(lambda a, b: a % b), "arith.minui": _binop(min),
            "arith.index_cast": _unop(int), "arith.cmpi": self._cmpi,
            "arith.addf": _binop(np.add), "arith.mulf": _binop(np.multiply), "arith.divf": _binop(np.divide),
            "arith.maximumf": _binop(np.maximum), "arith.minimumf": _binop(np.minimum),   # both propagate NaN
            "arith.extf": _unop(lambda x: np.asarray(x).astype(np.float32)),
            "arith.truncf": _unop(lambda x: np.asarray(x).astype(DTYPES["bf16"])),
            "math.rsqrt": _unop(lambda x: np.float32(1.0) / np.sqrt(np.float32(x))),
            "memref.alloc": self._alloc, "memref.dealloc": self._dealloc, "memref.load": self._load,
            "air.launch": self._launch, "air.segment": self._segment, "air.herd": self._herd,
            "air.dma_memcpy_nd": self._dma, "linalg.fill": self._fill, "linalg.generic": self._generic,
            "scf.for": self._for, "scf.if": self._if, CALL_OP: self._call,
        }
        self.terminators = {"scf.yield", "func.return", "air.launch_terminator", "air.segment_terminator",
                            "air.herd_terminator", "linalg.yield"}

    # ---- driving ----------------------------------------------------------------------
    def _reset(self) -> None:
        """A run starts clean, even after one that stopped at a failed check."""
        self.where = {"launch": "-", "herd": "-", "core": "-", "op": "-"}
        self._l1 = self._l2 = 0                                # live L1 bytes of the core, L2 of the segment
        # buffer id -> (the buffer, kept alive so its id is not reused; writing core per element)
        self._owners: dict[int, tuple[Buffer, np.ndarray]] | None = None
        self._core = -1
        self._loops = 0                                        # loop depth inside the current hierarchy body
        self._l3_written: dict[int, np.ndarray] | None = None  # per top-level launch, when checked
        self._top_launch = -1
        # Bytes the last run's DMAs moved from and into L3 (the host's buffers): what a module
        # costs in DDR bandwidth, which a resident cache's window sets.
        self.l3_read_bytes = self.l3_write_bytes = 0

    def run(self, args: list[np.ndarray]) -> None:
        """Execute the function on `args` (one flat array per function argument, written in place)."""
        self._reset()
        if len(args) != len(self.p.args):
            raise self.error(f"{len(args)} buffers for {len(self.p.args)} arguments")
        env: list = [None] * self.p.n_values
        self._arg_buffers = []
        for i, (vid, t, a) in enumerate(zip(self.p.args, self.p.arg_types, args)):
            if a.dtype != DTYPES[t.dtype] or a.size != math.prod(t.shape):
                raise self.error(f"argument {i} of type {t} given {a.dtype}[{a.size}]")
            env[vid] = Buffer(a, t.shape, L3, self.arg_names[i] if self.arg_names else f"%arg{i}", None)
            self._arg_buffers.append(env[vid])
        self._arg_index = {id(b): i for i, b in enumerate(self._arg_buffers)}
        self.block(self.p.body, env)

    def block(self, block: Block, env: list) -> None:
        for op in block.ops:
            handler = self.ops.get(op.name)
            if handler is None:
                if op.name in self.terminators:
                    continue
                self.where["op"] = op.name
                raise self.error("op not implemented by the interpreter")
            self.where["op"] = op.name
            handler(op, env)

    def error(self, message: str) -> InterpError:
        w = self.where
        return InterpError(f"{self.group}: launch {w['launch']}, herd {w['herd']} core {w['core']}, "
                           f"{w['op']}: {message}")

    # ---- scalars ----------------------------------------------------------------------
    def _constant(self, op: Op, env: list) -> None:
        t, v = op.types[0], op.attrs["value"]
        env[op.results[0]] = np.float32(v) if t == "f32" else DTYPES["bf16"].type(v) if t == "bf16" else int(v)

    def _cmpi(self, op: Op, env: list) -> None:
        a, b = (env[i] for i in op.operands)
        env[op.results[0]] = bool(_CMP[op.attrs["predicate"]](a, b))

    # ---- memory -----------------------------------------------------------------------
    def _alloc(self, op: Op, env: list) -> None:
        t = MemRefType.parse(op.types[0])
        if t.space not in (L1, L2):
            raise self.error(f"allocation in memory space {t.space}")
        if t.space == L2 and self._core >= 0:
            raise self.error(f"allocates L2 ({op.types[0]}) inside a herd: a core allocates only its own L1; "
                             f"allocate L2 in the segment and pass it to the herd")
        n = math.prod(t.shape)
        fill = np.nan if t.dtype in ("bf16", "f32") else 0   # poison: an unchecked float read shows as NaN
        buf = Buffer(np.full(n, fill, DTYPES[t.dtype]), t.shape, t.space, f"%{op.results[0]}",
                     np.zeros(n, bool))
        self._hold(buf, buf.nbytes)
        env[op.results[0]] = buf

    def _hold(self, buf: Buffer, nbytes: int) -> None:
        """Count `nbytes` more of `buf`'s memory against its budget (per core or per segment)."""
        if buf.space == L1:
            self._l1 += nbytes
            problem = hw_rules.l1_problem(self._l1)
        else:
            self._l2 += nbytes
            problem = hw_rules.l2_problem(self._l2)
        if problem:
            raise self.error(problem)

    def _dealloc(self, op: Op, env: list) -> None:
        buf = env[op.operands[0]]
        n = buf.nbytes * (hw_rules.DOUBLE_BUFFER if buf.doubled else 1)
        if buf.space == L1:
            self._l1 -= n
        else:
            self._l2 -= n

    def _load(self, op: Op, env: list) -> None:
        buf, *idx = (env[i] for i in op.operands)
        flat = int(np.ravel_multi_index(tuple(idx), buf.shape))
        self._check_read(buf, np.array([flat]))
        env[op.results[0]] = buf.data[flat]

    def _check_read(self, buf: Buffer, idx: np.ndarray | None) -> None:
        """`idx` None means the whole buffer."""
        if buf.written is not None:
            seen = buf.written if idx is None else buf.written[idx]
            if not seen.all():
                missing = int((~seen).sum())
                raise self.error(f"reads {missing} element(s) of {buf.name} (L{3 - buf.space}) never written "
                                 f"since allocation")
        if self._owners is not None and buf.space != L1:
            held = self._owners.get(id(buf))
            if held is not None:
                owner = held[1]
                o = owner if idx is None else owner[idx]
                if ((o >= 0) & (o != self._core)).any():
                    raise self.error(f"reads elements of {buf.name} that another core of this herd wrote")

    def _mark_written(self, buf: Buffer, idx: np.ndarray | None) -> None:
        if buf.written is not None:
            if idx is None:
                buf.written[:] = True
            else:
                buf.written[idx] = True
        if buf.space == L1:
            return
        if buf.space == L3 and self.launch_writes is not None and 0 <= self._top_launch < len(self.launch_writes):
            arg = self._arg_index.get(id(buf))
            if arg is not None and arg not in self.launch_writes[self._top_launch]:
                raise self.error(f"writes {buf.name}, which this launch does not declare as written")
        if self._owners is not None:
            owner = self._owners.setdefault(id(buf), (buf, np.full(buf.data.size, -1, np.int32)))[1]
            o = owner if idx is None else owner[idx]
            if ((o >= 0) & (o != self._core)).any():
                raise self.error(f"writes elements of {buf.name} that another core of this herd also writes")
            if idx is None:
                owner[:] = self._core
            else:
                owner[idx] = self._core
        if buf.space == L3 and self._l3_written is not None:
            mask = self._l3_written.setdefault(id(buf), np.zeros(buf.data.size, bool))
            if idx is None:
                mask[:] = True
            else:
                mask[idx] = True

    # ---- DMA --------------------------------------------------------------------------
    @staticmethod
    def _pattern(static: list[int], dyn: list[int], env: list) -> list[int]:
        vals, it = [], iter(dyn)
        for s in static:
            vals.append(int(env[next(it)]) if s == DYNAMIC else s)
        return vals

    def _indices(self, buf: Buffer, offsets: list[int], sizes: list[int], strides: list[int],
                 side: str) -> np.ndarray | None:
        if not sizes:
            return None
        if not (len(offsets) == len(sizes) == len(strides)):
            raise self.error(f"{side} pattern has {len(offsets)} offsets, {len(sizes)} sizes, {len(strides)} strides")
        base = sum(o * s for o, s in zip(offsets, strides))
        idx = np.array(base, dtype=np.int64)
        for size, stride in zip(sizes, strides):
            idx = idx[..., None] + np.arange(size, dtype=np.int64) * stride
        idx = idx.reshape(-1)
        n = buf.data.size
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise self.error(f"{side} {buf.name} accessed outside its {n} elements "
                             f"(offsets {offsets}, sizes {sizes}, strides {strides}: "
                             f"elements {int(idx.min())}..{int(idx.max())})")
        return idx

    def _dma(self, op: Op, env: list) -> None:
        _, dst, d_off, d_size, d_str, src, s_off, s_size, s_str = op.segments()
        a = op.attrs
        dbuf, sbuf = env[dst[0]], env[src[0]]
        dpat = [self._pattern(a[f"static_dst_{k}"], v, env) for k, v in
                (("offsets", d_off), ("sizes", d_size), ("strides", d_str))]
        spat = [self._pattern(a[f"static_src_{k}"], v, env) for k, v in
                (("offsets", s_off), ("sizes", s_size), ("strides", s_str))]
        di = self._indices(dbuf, *dpat, "destination")
        si = self._indices(sbuf, *spat, "source")
        dn = dbuf.data.size if di is None else di.size
        sn = sbuf.data.size if si is None else si.size
        if dn != sn:
            raise self.error(f"moves {sn} elements from {sbuf.name} into {dn} of {dbuf.name}")
        if dbuf.data.dtype != sbuf.data.dtype:
            raise self.error(f"copies {sbuf.data.dtype} into {dbuf.data.dtype}")
        for side, buf, pattern in (("destination", dbuf, dpat), ("source", sbuf, spat)):
            self._check_rules(side, buf, *pattern)
            if self._loops and buf.space != L3 and not buf.doubled:
                buf.doubled = True
                self._hold(buf, buf.nbytes)
        self._check_read(sbuf, si)
        if sbuf.space == L3:
            self.l3_read_bytes += sn * sbuf.data.itemsize
        if dbuf.space == L3:
            self.l3_write_bytes += dn * dbuf.data.itemsize
        values = sbuf.data if si is None else sbuf.data[si]
        if di is None:
            dbuf.data[:] = values
        else:
            dbuf.data[di] = values
        self._mark_written(dbuf, di)

    def _check_rules(self, side: str, buf: Buffer, offsets: list[int], sizes: list[int], strides: list[int]) -> None:
        """The DMA serving this side's memory must be able to move this iteration's pattern."""
        item = buf.data.itemsize
        first = sum(o * s for o, s in zip(offsets, strides)) * item
        problems = hw_rules.dma_side_problems(buf.space, item, first, sizes, strides, buf.nbytes)
        if problems:
            raise self.error(f"{side} {buf.name} ({hw_rules.ENGINE[buf.space].tile}): " + "; ".join(problems))

    # ---- compute ----------------------------------------------------------------------
    def _fill(self, op: Op, env: list) -> None:
        value, out = env[op.operands[0]], env[op.operands[1]]
        out.data[:] = value
        self._mark_written(out, None)

    def _generic(self, op: Op, env: list) -> None:
        n_in, n_out = op.attrs["operandSegmentSizes"]
        bufs = [env[i] for i in op.operands]
        ins, outs = bufs[:n_in], bufs[n_in:]
        for b in ins:
            self._check_read(b, None)
        try:
            reads_outs = generic(op, ins, outs, env, self.block)
        except (ValueError, NotImplementedError) as e:
            raise self.error(str(e)) from None
        for b in outs:
            if reads_outs:
                self._check_read(b, None)
            self._mark_written(b, None)

    def _call(self, op: Op, env: list) -> None:
        symbol = op.attrs["callee"]
        ext = self.externs.get(symbol)
        if ext is None:
            raise self.error(f"calls @{symbol}, which has no host build")
        args = [env[i] for i in op.operands]
        for i in ext.reads:
            self._check_read(args[i], None)
        ext.fn(*(a.data if isinstance(a, Buffer) else int(a) for a in args))
        for i in ext.writes:
            self._mark_written(args[i], None)

    # ---- control flow -----------------------------------------------------------------
    def _for(self, op: Op, env: list) -> None:
        lb, ub, step = (int(env[i]) for i in op.operands[:3])
        if step <= 0:
            raise self.error(f"loop step {step} (scf.for needs a positive step)")
        body = op.regions[0]
        self._loops += 1
        for iv in range(lb, ub, step):
            env[body.args[0]] = iv
            self.block(body, env)
        self._loops -= 1

    def _if(self, op: Op, env: list) -> None:
        if env[op.operands[0]]:
            self.block(op.regions[0], env)
        elif len(op.regions) > 1:
            self.block(op.regions[1], env)

    # ---- hierarchy --------------------------------------------------------------------
    def _hierarchy(self, op: Op, env: list) -> tuple[list[int], Block, list]:
        _, sizes, operands = op.segments()
        return [int(env[s]) for s in sizes], op.regions[0], [env[o] for o in operands]

    def _bind(self, body: Block, ids: tuple[int, ...], sizes: list[int], operands: list, env: list) -> None:
        self._loops = 0     # a hierarchy body starts its own loops: the compiler ping-pongs within it
        values = list(ids) + sizes + operands
        if len(body.args) != len(values):
            raise self.error(f"body takes {len(body.args)} arguments, expected {len(values)}")
        for arg, v in zip(body.args, values):
            env[arg] = v

    def _launch(self, op: Op, env: list) -> None:
        loops = self._loops
        sizes, body, operands = self._hierarchy(op, env)
        top = self.where["launch"] == "-"
        if top:
            self._top_launch += 1
            self._l3_written = {} if self.launch_writes is not None else None
        self.where["launch"] = op.attrs.get("sym_name", "?")
        for ids in itertools.product(*(range(s) for s in sizes)):
            self._bind(body, ids, sizes, operands, env)
            self.block(body, env)
        if top:
            self._check_launch_coverage()
            self.where["launch"] = "-"
        self._loops = loops

    def _check_launch_coverage(self) -> None:
        if self.launch_writes is None:
            return
        if self._top_launch >= len(self.launch_writes):
            raise self.error(f"launch {self._top_launch} is beyond the {len(self.launch_writes)} declared")
        for arg_index in self.launch_writes[self._top_launch]:
            if arg_index in self.partial_writes:
                continue
            buf = self._arg_buffers[arg_index]
            mask = self._l3_written.get(id(buf))
            covered = 0 if mask is None else int(mask.sum())
            if covered != buf.data.size:
                raise self.error(f"leaves {buf.data.size - covered} of {buf.data.size} elements of "
                                 f"{buf.name} unwritten")
        self._l3_written = None

    def _segment(self, op: Op, env: list) -> None:
        loops = self._loops
        sizes, body, operands = self._hierarchy(op, env)
        for ids in itertools.product(*(range(s) for s in sizes)):
            self._bind(body, ids, sizes, operands, env)
            l2 = self._l2
            self.block(body, env)
            self._l2 = l2
        self._loops = loops

    def _herd(self, op: Op, env: list) -> None:
        loops = self._loops
        sizes, body, operands = self._hierarchy(op, env)
        name = op.attrs.get("sym_name", "?")
        problem = hw_rules.herd_problem(sizes)
        if problem:
            self.where["herd"] = name
            raise self.error(problem)
        outer = self._owners
        self._owners = {}
        for core, (ty, tx) in enumerate(itertools.product(range(sizes[1]), range(sizes[0]))):
            self.where["herd"], self.where["core"] = name, f"({tx},{ty})"
            self._core = core
            self._bind(body, (tx, ty), sizes, operands, env)
            l1 = self._l1
            self.block(body, env)
            self._l1 = l1
        self._owners = outer
        self._core, self._loops = -1, loops
        self.where["herd"], self.where["core"] = "-", "-"


def _binop(f):
    def run(op: Op, env: list) -> None:
        env[op.results[0]] = f(env[op.operands[0]], env[op.operands[1]])
    return run


def _unop(f):
    def run(op: Op, env: list) -> None:
        env[op.results[0]] = f(env[op.operands[0]])
    return run
