"""Checks a MLIR-AIR module without the AIR dialect: parse + verify, plus what the parser can't see.

`iree.compiler.ir` parses our generic-form AIR ops as unregistered operations. That verifies
everything registered (func, memref, arith, scf, linalg, math) but treats AIR regions as
opaque graph regions, so the checks AIR's own verifiers and the lowering rely on are redone
here on the parsed IR:

- hierarchy ops: segment sizes against the operand count, block arguments (ids, sizes,
  kernel arguments with the operands' types), terminator, launch ⊃ segment ⊃ herd nesting,
  herd sizes from `arith.constant`, unique `sym_name`s;
- isolation: nothing inside a launch/segment/herd uses a value from outside it except
  through its operands (the parser cannot know the ops are IsolatedFromAbove);
- use-before-def anywhere, since graph regions allow it syntactically;
- memory: allocations in a herd are L1, in a segment L2 or L1; loads, stores, linalg
  operands and kernel-call operands in a herd are L1; DMA access patterns are consistent;
- channels: put/get name a declared `air.channel`, with a fitting number of indices, and
  every channel has both ends;
- external calls: IREE's verifier rejects a `func.call` inside an unregistered region (the
  region looks like a symbol table), so each call is rewritten to `"mlir_validate.call"`
  carrying the callee before parsing, and callee names and types are checked here against
  the `func.func private` declarations (which must say `link_with`).

`cross_check` then compares the parsed module with its group declaration.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from iree.compiler import ir

from kernel_builder.externs import externs_for_launch
from kernel_builder.mlir.common import slot_type
from kernel_builder.mlir.emit import DYNAMIC, L1, L2
from multi_launch_builder.hw_check import check_function, location

CALL_OP = "mlir_validate.call"
HIERARCHY = ("air.launch", "air.segment", "air.herd")
_PARENT = {"air.launch": None, "air.segment": "air.launch", "air.herd": "air.segment"}
_SEGMENTS = {"air.launch": {3}, "air.segment": {3}, "air.herd": {3}, "air.dma_memcpy_nd": {9},
             "air.channel.put": {6, 7}, "air.channel.get": {6}}
_DIRECT_ACCESS = ("memref.load", "memref.store", "vector.transfer_read", "vector.transfer_write",
                  "vector.load", "vector.store")
_CALL = re.compile(r"^(\s*(?:%[^=]+=\s*)?)(?:func\.)?call\s+@([\w$.\-]+)\s*\(([^)]*)\)\s*:", re.M)


class MlirValidationError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid MLIR-AIR module:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class LaunchUse:
    """What one top-level `air.launch` does with the function's arguments (by index)."""

    name: str
    args: tuple[int | None, ...]     # kernel operands; None when not a function argument
    reads: frozenset[int]            # arguments some DMA reads from
    writes: frozenset[int]           # arguments some DMA writes to
    herds: tuple[tuple[int, ...], ...] = ()  # sizes of the herds inside, in order


@dataclass(frozen=True)
class ModuleSummary:
    func_name: str
    arg_types: tuple[str, ...]
    launches: tuple[LaunchUse, ...]
    externs: dict[str, str] = field(default_factory=dict)  # symbol -> link_with object
    herd_links: tuple[tuple[str, str | None, frozenset[str]], ...] = ()  # (herd, its link_with, callees)


def rewrite_calls(text: str) -> str:
    """Calls become a generic op that keeps the callee; line numbers are preserved."""
    return _CALL.sub(lambda m: f'{m.group(1)}"{CALL_OP}"({m.group(3)}) {{callee = @{m.group(2)}}} :', text)


def validate_module(text: str) -> ModuleSummary:
    """Parse, verify and structurally check `text`; raise MlirValidationError listing every problem."""
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        try:
            module = ir.Module.parse(rewrite_calls(text))
        except ir.MLIRError as e:
            raise MlirValidationError([f"parse/verify: {e}"]) from None
        checker = _Checker(module)
        summary = checker.run()
    if checker.problems:
        raise MlirValidationError(checker.problems)
    return summary


def cross_check(summary: ModuleSummary, group) -> None:
    """The module's function, launches and per-launch argument use must be the declaration's."""
    problems = []
    if summary.func_name != group.name:
        problems.append(f"function @{summary.func_name}, declaration names the group {group.name}")
    with ir.Context():
        want = tuple(str(ir.Type.parse(slot_type(s))) for s in group.slots)
    if summary.arg_types != want:
        problems.append(f"function arguments {list(summary.arg_types)} != slots {list(want)}")
    if len(summary.launches) != len(group.launches):
        problems.append(f"{len(summary.launches)} launches, declaration has {len(group.launches)}")
    for got, launch in zip(summary.launches, group.launches):
        args = tuple(group.index(a) for a in launch.args)
        reads = frozenset(group.index(a) for a in launch.reads)
        writes = frozenset(group.index(a) for a in launch.writes)
        if got.args != args:
            problems.append(f"launch {got.name} takes arguments {got.args}, {launch.name} declares {args}")
        if got.reads != reads or got.writes != writes:
            problems.append(f"launch {got.name} reads {sorted(got.reads)} / writes {sorted(got.writes)}, "
                            f"{launch.name} declares {sorted(reads)} / {sorted(writes)}")
        herd = launch.param_dict.get("herd")
        if herd is not None and (not got.herds or any(h != tuple(herd) for h in got.herds)):
            problems.append(f"launch {got.name} runs herds {list(got.herds)}, {launch.name} declares {tuple(herd)}")
    problems += _link_problems(summary, group)
    if problems:
        raise MlirValidationError([f"{group.name}: {p}" for p in problems])


def _link_problems(summary: ModuleSummary, group) -> list[str]:
    """Every herd that calls a kernel names, in `link_with`, the object that defines it (the
    extern contract's `link_object`), and so does every declaration: a wrong name links on
    no machine without the toolchain, so nothing else would notice."""
    defined = {k.symbol: k.link_object for launch in group.launches for k in externs_for_launch(launch)}
    problems = []
    for sym, obj in summary.externs.items():
        if sym in defined and obj != defined[sym]:
            problems.append(f"@{sym} is declared with link_with {obj!r}; it is defined in {defined[sym]!r}")
    for herd, link, callees in summary.herd_links:
        for callee in sorted(callees):
            want = defined.get(callee)
            if want is None:
                problems.append(f"herd {herd} calls @{callee}, which no launch of the group declares")
            elif link != want:
                problems.append(f"herd {herd} calls @{callee} (defined in {want!r}) but links "
                                f"{repr(link) if link else 'no object'}")
    return problems


def validate_group_module(text: str, group) -> ModuleSummary:
    try:
        summary = validate_module(text)
    except MlirValidationError as e:
        raise MlirValidationError([f"{group.name}: {p}" for p in e.problems]) from None
    cross_check(summary, group)
    return summary


# ---- the checker ---------------------------------------------------------------------------


def _space(t: ir.Type) -> int | None:
    if not isinstance(t, ir.MemRefType):
        return None
    return 0 if t.memory_space is None else ir.IntegerAttr(t.memory_space).value


class _Checker:
    def __init__(self, module: ir.Module):
        self.module = module
        self.problems: list[str] = []
        self.externs: dict[str, ir.Operation] = {}
        self.channels: dict[str, ir.Operation] = {}
        self.channel_ends: dict[str, set[str]] = {}
        self.called: set[str] = set()
        self.sym_names: dict[str, str] = {}
        self.all_values: set = set()
        self.herd_calls: dict = {}      # herd op -> callees

    def problem(self, op, msg: str) -> None:
        self.problems.append(f"{location(op)}: {op.name}: {msg}")

    # -- attributes (AIR inherent attributes may also arrive as properties) --
    def attr(self, op, name: str):
        if name in op.attributes:
            return op.attributes[name]
        head = op.get_asm(print_generic_op_form=True, skip_regions=True, use_local_scope=True)
        m = re.search(r"<(\{.*?\})>", head.split("\n", 1)[0])
        if m:
            props = ir.DictAttr(ir.Attribute.parse(m.group(1)))
            if name in props:
                return props[name]
        return None

    def segments(self, op) -> list[int] | None:
        a = self.attr(op, "operandSegmentSizes")
        if a is None:
            self.problem(op, "has no operandSegmentSizes")
            return None
        segs = list(ir.DenseI32ArrayAttr(a))
        if len(segs) not in _SEGMENTS[op.name]:
            self.problem(op, f"operandSegmentSizes has {len(segs)} groups, expected {sorted(_SEGMENTS[op.name])}")
            return None
        if sum(segs) != len(op.operands):
            self.problem(op, f"operandSegmentSizes {segs} add up to {sum(segs)}, op has {len(op.operands)} operands")
            return None
        return segs

    # -- driver --
    def run(self) -> ModuleSummary | None:
        funcs = []
        for op in self.module.body.operations:
            op = op.operation
            if op.name == "func.func":
                vis = op.attributes["sym_visibility"] if "sym_visibility" in op.attributes else None
                if vis is not None and ir.StringAttr(vis).value == "private":
                    self.externs[ir.StringAttr(op.attributes["sym_name"]).value] = op
                else:
                    funcs.append(op)
            elif op.name == "air.channel":
                name = self.attr(op, "sym_name")
                self.channels[ir.StringAttr(name).value if name else "?"] = op
        for name, op in self.externs.items():
            if len(op.regions[0].blocks):
                self.problem(op, f"@{name} is private but has a body")
            if "link_with" not in op.attributes:
                self.problem(op, f"external kernel @{name} has no link_with")
        if len(funcs) != 1:
            self.problems.append(f"module has {len(funcs)} public functions, expected 1")
            return None
        func = funcs[0]
        entry = func.regions[0].blocks[0]
        for o in self._walk(func):
            self.all_values.update(o.results)
        self._scope(entry, set(), set(), None)
        self._visit_block(entry, [])
        if not self.problems:           # the hardware rules read a structure the checks above vouch for
            self.problems += check_function(func)
        for name in self.externs:
            if name not in self.called:
                self.problems.append(f"external kernel @{name} is declared but never called")
        for name, ends in self.channel_ends.items():
            if ends != {"air.channel.put", "air.channel.get"}:
                self.problems.append(f"channel @{name} has only {sorted(ends)}: a transfer needs both ends")
        return self._summary(func, entry)

    def _walk(self, op) -> Iterable:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    inner = inner.operation
                    yield inner
                    yield from self._walk(inner)

    # -- scoping: use-before-def and isolation in one pass --
    def _scope(self, block, visible: set, captured: set, owner) -> None:
        vis = set(visible)
        vis.update(block.arguments)
        for op in block.operations:
            op = op.operation
            for v in op.operands:
                if v in vis:
                    continue
                if v in captured:
                    self.problem(op, f"inside {owner.name} uses a value defined outside it; "
                                     f"{owner.name} is isolated from above, pass it as an operand")
                elif v in self.all_values:
                    self.problem(op, "uses a value before its definition")
                else:
                    self.problem(op, "uses a value that is not in scope")
            for region in op.regions:
                for inner in region.blocks:
                    if op.name in HIERARCHY:
                        self._scope(inner, set(), captured | vis, op)
                    else:
                        self._scope(inner, vis, captured, owner)
            vis.update(op.results)

    # -- per-op rules --
    def _visit_block(self, block, stack: list) -> None:
        for op in block.operations:
            op = op.operation
            self._check_op(op, stack)
            inner_stack = stack + [op] if op.name in HIERARCHY else stack
            for region in op.regions:
                for inner in region.blocks:
                    self._visit_block(inner, inner_stack)

    def _check_op(self, op, stack: list) -> None:
        herd = next((h for h in reversed(stack) if h.name == "air.herd"), None)
        in_segment = any(h.name == "air.segment" for h in stack)
        name = op.name
        if name in HIERARCHY:
            self._check_hierarchy(op, stack)
        elif name == "air.dma_memcpy_nd":
            self._check_dma(op)
        elif name in ("air.channel.put", "air.channel.get"):
            self._check_channel_op(op)
        elif name == CALL_OP:
            self._check_call(op, herd)
        elif name == "memref.alloc":
            space = _space(op.results[0].type)
            if herd is not None and space != L1:
                self.problem(op, f"allocation in a herd must be L1 (memory space {L1}), got {space}")
            elif herd is None and in_segment and space not in (L1, L2):
                self.problem(op, f"allocation in a segment must be L2 or L1, got memory space {space}")
        if herd is not None and (name in _DIRECT_ACCESS or name.startswith("linalg.")):
            for v in op.operands:
                space = _space(v.type)
                if space is not None and space != L1:
                    self.problem(op, f"a core can only touch L1 directly, operand is in memory space {space}; "
                                     "stage it with air.dma_memcpy_nd")

    def _check_hierarchy(self, op, stack: list) -> None:
        parent = next((h.name for h in reversed(stack)), None)
        if parent != _PARENT[op.name]:
            self.problem(op, f"must be nested directly in {_PARENT[op.name] or 'the function'}, found in {parent}")
        sym = self.attr(op, "sym_name")
        if sym is not None:
            s = ir.StringAttr(sym).value
            if s in self.sym_names:
                self.problem(op, f"sym_name {s!r} is already used by a {self.sym_names[s]}")
            self.sym_names[s] = op.name
        segs = self.segments(op)
        if segs is None:
            return
        deps, ndims, nk = segs
        if len(op.regions) != 1 or len(op.regions[0].blocks) != 1:
            self.problem(op, "needs exactly one region with one block")
            return
        block = op.regions[0].blocks[0]
        args = list(block.arguments)
        operands = list(op.operands)
        if len(args) != 2 * ndims + nk:
            self.problem(op, f"body has {len(args)} arguments, expected {ndims} ids + {ndims} sizes + {nk} operands")
            return
        index = ir.IndexType.get()
        for v in operands[:deps]:
            if "air.async.token" not in str(v.type):
                self.problem(op, f"async dependency of type {v.type}")
        for v in operands[deps:deps + ndims] + [a for a in args[:2 * ndims]]:
            if v.type != index:
                self.problem(op, f"ids and sizes must be index, got {v.type}")
        for i, (a, v) in enumerate(zip(args[2 * ndims:], operands[deps + ndims:])):
            if a.type != v.type:
                self.problem(op, f"kernel argument {i} is {a.type} but its operand is {v.type}")
        ops = [o.operation for o in block.operations]
        term = op.name + "_terminator"
        if not ops or ops[-1].name != term or len(ops[-1].operands):
            self.problem(op, f"body must end in {term}")
        if any(o.name == term for o in ops[:-1]):
            self.problem(op, f"{term} before the end of the body")
        if op.name == "air.herd":
            if ndims not in (1, 2):
                self.problem(op, f"a herd is 1-D or 2-D, not {ndims}-D")
            for v in operands[deps:deps + ndims]:
                if not isinstance(v, ir.OpResult) or v.owner.name != "arith.constant":
                    self.problem(op, "herd sizes must be arith.constant values")

    def _check_dma(self, op) -> None:
        segs = self.segments(op)
        if segs is None:
            return
        if segs[1] != 1 or segs[5] != 1:
            self.problem(op, "needs exactly one destination and one source memref")
            return
        operands = list(op.operands)
        pos = 0
        for side, start in (("dst", 1), ("src", 5)):
            pos = sum(segs[:start])
            if not isinstance(operands[pos].type, ir.MemRefType):
                self.problem(op, f"{side} is {operands[pos].type}, not a memref")
            ranks = []
            for k, kind in enumerate(("offsets", "sizes", "strides")):
                n_dyn = segs[start + 1 + k]
                dyn = operands[sum(segs[:start + 1 + k]):sum(segs[:start + 2 + k])]
                if any(v.type != ir.IndexType.get() for v in dyn):
                    self.problem(op, f"{side} {kind} must be index values")
                static = self.attr(op, f"static_{side}_{kind}")
                if static is None:
                    ranks.append(n_dyn)
                    continue
                entries = list(ir.DenseI64ArrayAttr(static))
                if sum(e == DYNAMIC for e in entries) != n_dyn:
                    self.problem(op, f"static_{side}_{kind} marks {sum(e == DYNAMIC for e in entries)} "
                                     f"dynamic entries for {n_dyn} operands")
                ranks.append(len(entries))
            if len(set(ranks)) != 1:
                self.problem(op, f"{side} offsets/sizes/strides have ranks {ranks}")

    def _check_channel_op(self, op) -> None:
        segs = self.segments(op)
        ref = self.attr(op, "chan_name")
        if ref is None:
            self.problem(op, "has no chan_name")
            return
        chan = ir.FlatSymbolRefAttr(ref).value
        self.channel_ends.setdefault(chan, set()).add(op.name)
        decl = self.channels.get(chan)
        if decl is None:
            self.problem(op, f"channel @{chan} is not declared by an air.channel at module level")
            return
        size = self.attr(decl, "size")
        dims = len(ir.ArrayAttr(size)) if size is not None else 0
        if segs is not None and segs[1] not in (0, dims):
            self.problem(op, f"{segs[1]} indices into channel @{chan} of rank {dims}")

    def _check_call(self, op, herd) -> None:
        ref = op.attributes["callee"] if "callee" in op.attributes else None
        if ref is None:
            self.problem(op, "call without callee")
            return
        callee = ir.FlatSymbolRefAttr(ref).value
        self.called.add(callee)
        if herd is not None:
            self.herd_calls.setdefault(herd, set()).add(callee)
        decl = self.externs.get(callee)
        if decl is None:
            self.problem(op, f"calls @{callee}, which no func.func private declares")
            return
        ftype = ir.FunctionType(ir.TypeAttr(decl.attributes["function_type"]).value)
        got_in, got_out = [v.type for v in op.operands], [r.type for r in op.results]
        if list(ftype.inputs) != got_in or list(ftype.results) != got_out:
            self.problem(op, f"calls @{callee} with ({', '.join(map(str, got_in))}) -> "
                             f"({', '.join(map(str, got_out))}), declared {ftype}")
        if herd is None:
            self.problem(op, f"external kernel @{callee} called outside a herd")
        for v in op.operands:
            space = _space(v.type)
            if space is not None and space != L1:
                self.problem(op, f"@{callee} gets a memref in memory space {space}; kernels take L1 buffers")

    # -- summary for the cross-check --
    def _summary(self, func, entry) -> ModuleSummary:
        fargs = list(entry.arguments)
        arg_index = {a: i for i, a in enumerate(fargs)}
        launches = []
        for op in entry.operations:
            op = op.operation
            if op.name != "air.launch":
                continue
            segs = self.segments(op) or [0, 0, 0]
            kernel_ops = list(op.operands)[segs[0] + segs[1]:]
            block = op.regions[0].blocks[0]
            bind = {a: arg_index.get(v) for a, v in zip(list(block.arguments)[2 * segs[1]:], kernel_ops)}
            reads, writes = set(), set()
            self._flow(block, {k: v for k, v in bind.items() if v is not None}, reads, writes)
            sym = self.attr(op, "sym_name")
            herds = tuple(self._herd_sizes(h) for h in self._walk(op) if h.name == "air.herd")
            launches.append(LaunchUse(ir.StringAttr(sym).value if sym else "?",
                                      tuple(arg_index.get(v) for v in kernel_ops),
                                      frozenset(reads), frozenset(writes), herds))
        herd_links = tuple((ir.StringAttr(self.attr(h, "sym_name")).value if self.attr(h, "sym_name") else "?",
                            ir.StringAttr(h.attributes["link_with"]).value if "link_with" in h.attributes else None,
                            frozenset(calls)) for h, calls in self.herd_calls.items())
        return ModuleSummary(ir.StringAttr(func.attributes["sym_name"]).value,
                             tuple(str(a.type) for a in fargs), tuple(launches),
                             {n: ir.StringAttr(o.attributes["link_with"]).value
                              for n, o in self.externs.items() if "link_with" in o.attributes}, herd_links)

    def _herd_sizes(self, herd) -> tuple[int, ...]:
        segs = self.segments(herd) or [0, 0, 0]
        sizes = list(herd.operands)[segs[0]:segs[0] + segs[1]]
        return tuple(ir.IntegerAttr(v.owner.attributes["value"]).value
                     if isinstance(v, ir.OpResult) and v.owner.name == "arith.constant" else -1
                     for v in sizes)

    def _flow(self, block, bind: dict, reads: set, writes: set) -> None:
        """Follow function arguments through nested hierarchy operands to the DMAs that move them."""
        for op in block.operations:
            op = op.operation
            if op.name == "air.dma_memcpy_nd":
                segs = self.segments(op)
                if segs:
                    operands = list(op.operands)
                    dst, src = operands[segs[0]], operands[sum(segs[:5])]
                    if dst in bind:
                        writes.add(bind[dst])
                    if src in bind:
                        reads.add(bind[src])
            inner_bind = bind
            if op.name in HIERARCHY:
                segs = self.segments(op) or [0, 0, 0]
                blk = op.regions[0].blocks[0]
                pairs = zip(list(blk.arguments)[2 * segs[1]:], list(op.operands)[segs[0] + segs[1]:])
                inner_bind = {a: bind[v] for a, v in pairs if v in bind}
            for region in op.regions:
                for inner in region.blocks:
                    self._flow(inner, inner_bind, reads, writes)
