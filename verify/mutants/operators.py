"""Mutation operators over a stitched group module's text, and the rules that prove a mutant
equivalent.

Each operator finds its sites in the module the stitcher emits (one op per line, generic-form
AIR ops, pretty `scf.for` / `func.call` / arith) and makes one small change at one site. Where a
change needs a new value (an offset plus one, a loop bound halved), the mutant defines it with
new `arith` ops on the lines just before the op it feeds, so the result stays well-formed
wherever the original was; whether it parses and verifies is still checked for every mutant.

A mutant is marked equivalent only by a rule that proves it computes the same outputs
(`Mutant.equivalent` names the rule); those rules are listed in docs/explain.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from llama_base.group_contract import KernelGroup

NEW = "%mutant"       # the prefix of every value a mutant adds (no builder emits it)
COMMUTATIVE = {"arith.addf", "arith.mulf", "arith.addi", "arith.muli", "arith.maximumf", "arith.minimumf",
               "arith.minui"}
BINARY = COMMUTATIVE | {"arith.divf", "arith.divui", "arith.remui", "arith.subi"}
# Launch ops whose two inputs are read with one access pattern and combined commutatively.
COMMUTATIVE_LAUNCHES = {"add"}
# Predicate widenings: the new predicate holds wherever the old one did.
WIDER = {"ugt": "uge", "ult": "ule", "sgt": "sge", "slt": "sle"}
# External kernels whose result does not change when two arguments trade places, by their
# source: RoPE's outputs are x[i]*lut[i] -/+ x[j]*lut[j] sums, symmetric in x and the table row.
SYMMETRIC_EXTERN_ARGS = {"rope_halfsplit_bf16_": (0, 1)}
NARROWER = {"ugt": "ult", "ult": "ugt", "uge": "ugt", "ule": "ult", "eq": "ne", "ne": "eq"}

_DMA = re.compile(r'^(\s*)"air\.dma_memcpy_nd"\(([^)]*)\) \{operandSegmentSizes = array<i32: ([^>]*)>')
_FOR = re.compile(r"^(\s*)scf\.for (%\S+) = (%\S+) to (%\S+) step (%\S+) \{$")
_HERD = re.compile(r'^(\s*)"air\.herd"\(([^)]*)\)')
_LAUNCH = re.compile(r'^(\s*)"air\.launch"\(([^)]*)\)')
_CALL = re.compile(r"^(\s*)func\.call @(\S+)\(([^)]*)\) : \((.*)\) -> \(\)$")
_BIN = re.compile(r"^(\s*)(%\S+) = (arith\.\w+) (%\S+), (%\S+) : (\S+)$")
_CMPI = re.compile(r"^(\s*)(%\S+) = arith\.cmpi (\w+), (%\S+), (%\S+) : (\S+)$")
_CONST = re.compile(r"^(\s*)(%\S+) = arith\.constant (\S+) : (index|f32|bf16|i32)$")
_LOAD = re.compile(r"^(\s*)(%\S+) = memref\.load (\S+)\[[^\]]*\] : memref<[^>]*xi32[^>]*>$")
_CAST = re.compile(r"^(\s*)(%\S+) = arith\.index_cast (%\S+) : (\S+) to (\S+)$")
_INS = re.compile(r"ins\((%[^,\s]+), (%[^,\s]+) : (.*)\) outs\(")
_CLOSE_ATTRS = re.compile(r'sym_name = "([^"]+)"')


@dataclass(frozen=True)
class Mutant:
    operator: str
    site: str             # stable name of the place: launch, op and position
    text: str
    equivalent: str = ""  # the rule proving it changes no output, if one does


def _split_types(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()] if cur.strip() else out


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


class Module:
    """The text as lines, with the facts the operators need: constants, and the launch each
    line belongs to."""

    def __init__(self, text: str, group: KernelGroup):
        self.text, self.group = text, group
        self.lines = text.split("\n")
        self.consts: dict[str, str] = {}
        for line in self.lines:
            c = _CONST.match(line)
            if c:
                self.consts[c.group(2)] = c.group(3)
        # each line belongs to the launch whose closing line (with its sym_name) ends it
        self.owner = ["-"] * len(self.lines)
        start = 0
        for i, line in enumerate(self.lines):
            a = _CLOSE_ATTRS.search(line)
            if a and a.group(1).endswith("_launch") and line.lstrip().startswith("})"):
                for j in range(start, i + 1):
                    self.owner[j] = a.group(1)[: -len("_launch")]
                start = i + 1

    def const(self, name: str) -> int | None:
        v = self.consts.get(name)
        try:
            return int(v) if v is not None else None
        except ValueError:
            return None

    def replace(self, i: int, new_line: str, before: tuple[str, ...] = ()) -> str:
        indent = re.match(r"^\s*", self.lines[i]).group(0)
        lines = self.lines[:i] + [indent + b for b in before] + [new_line] + self.lines[i + 1:]
        return "\n".join(lines)

    def delete(self, i: int) -> str:
        return "\n".join(self.lines[:i] + self.lines[i + 1:])

    def site(self, i: int, what: str) -> str:
        return f"{self.owner[i]}:{what}@{sum(1 for j in range(i) if self.owner[j] == self.owner[i])}"


def _with_operand(line: str, start: int, end: int, names: list[str], k: int, new: str) -> str:
    names = list(names)
    names[k] = new
    return line[:start] + ", ".join(names) + line[end:]


def _derived(orig: str, op: str, amount: int) -> tuple[tuple[str, ...], str]:
    return ((f"{NEW}_c = arith.constant {amount} : index", f"{NEW}_v = {op} {orig}, {NEW}_c : index"), f"{NEW}_v")


# ---- operators: each yields Mutants ------------------------------------------------------------

DMA_FIELDS = ("dst_offset", "dst_size", "dst_stride", None, "src_offset", "src_size", "src_stride")
FIELD_CHANGES = {"offset": (("arith.addi", 1),), "size": (("arith.divui", 2), ("arith.addi", 1)),
                 "stride": (("arith.muli", 2), ("arith.addi", 1))}


def _dma_operands(d: re.Match) -> tuple[list[str], list[tuple[int, str, str, int, int]]]:
    """A matched DMA's operand names, and (index in them, side, kind, dim, segment length) of
    each of its offset, size and stride operands, read from its operand segment sizes."""
    names, segs = _names(d.group(2)), [int(x) for x in d.group(3).split(",")]
    fields = []
    pos = sum(segs[:2])                               # past deps and the destination
    for seg, field in zip(segs[2:], DMA_FIELDS):
        if field is not None:                         # None: the source memref
            side, kind = field.split("_")
            fields += [(pos + dim, side, kind, dim, seg) for dim in range(seg)]
        pos += seg
    return names, fields


def _unit_stride(m: Module, names: list[str], k: int, seg: int) -> bool:
    """The stride operand `k` belongs to a dimension of size 1 at offset 0: one element, at the
    same address whatever the stride."""
    return m.const(names[k - seg]) == 1 and m.const(names[k - 2 * seg]) == 0


def dma_patterns(m: Module):
    """Offsets, sizes and strides of DMAs: plus one, halved, doubled."""
    for i, line in enumerate(m.lines):
        d = _DMA.match(line)
        if not d:
            continue
        names, fields = _dma_operands(d)
        for k, side, kind, dim, seg in fields:
            for op, amount in FIELD_CHANGES[kind]:
                before, new = _derived(names[k], op, amount)
                text = m.replace(i, _with_operand(line, d.start(2), d.end(2), names, k, new), before)
                eq = ""
                if kind == "stride" and _unit_stride(m, names, k, seg):
                    eq = "stride of a unit dimension at offset 0: one element, at the same address"
                yield Mutant(f"dma_{kind}_{op.split('.')[1]}{amount}", m.site(i, f"dma.{side}.{kind}{dim}"), text, eq)


def loops(m: Module):
    """Loop bounds and steps: lower bound plus a step, upper bound halved, step doubled."""
    for i, line in enumerate(m.lines):
        f = _FOR.match(line)
        if not f:
            continue
        indent, iv, lb, ub, st = f.groups()
        lbv, ubv, stv = m.const(lb), m.const(ub), m.const(st)
        for what, before, new_line in (
                ("lb", _derived(lb, "arith.addi", stv or 1)[0], f"{indent}scf.for {iv} = {NEW}_v to {ub} step {st} {{"),
                ("ub", _derived(ub, "arith.divui", 2)[0], f"{indent}scf.for {iv} = {lb} to {NEW}_v step {st} {{"),
                ("step", _derived(st, "arith.muli", 2)[0], f"{indent}scf.for {iv} = {lb} to {ub} step {NEW}_v {{")):
            eq = ""
            if None not in (lbv, ubv, stv) and stv > 0:
                new = {"lb": range(lbv + stv, ubv, stv), "ub": range(lbv, ubv // 2, stv),
                       "step": range(lbv, ubv, 2 * stv)}[what]
                if list(new) == list(range(lbv, ubv, stv)):
                    eq = "the loop runs the same iterations (constant bounds)"
            yield Mutant(f"loop_{what}", m.site(i, f"for.{what}"), m.replace(i, new_line, before), eq)


def herds(m: Module, idle: set[tuple[str, int, int]] | None = None):
    """Herd sizes halved. `idle` holds (herd, x, y) cores that wrote nothing outside their own
    L1 in a run of the original: a herd that loses only such cores computes the same."""
    for i, line in enumerate(m.lines):
        h = _HERD.match(line)
        if not h:
            continue
        names = _names(h.group(2))
        herd = next((x.group(1) for x in (_CLOSE_ATTRS.search(l) for l in m.lines[i:])
                     if x and x.group(1).endswith("_herd")), "?")
        sizes = [m.const(n) for n in names[:2]]
        for dim in (0, 1):
            v = sizes[dim]
            if not v or v < 2:
                continue
            before = (f"{NEW}_c = arith.constant {v // 2} : index",)
            text = m.replace(i, _with_operand(line, h.start(2), h.end(2), names, dim, f"{NEW}_c"), before)
            eq = ""
            if idle is not None and sizes[1 - dim]:
                gone = [(x, y) for x in range(sizes[0]) for y in range(sizes[1])
                        if (x if dim == 0 else y) >= v // 2]
                if all((herd, x, y) in idle for x, y in gone):
                    eq = "the cores removed did no work outside their own L1 in the original (nothing to assign)"
            yield Mutant(f"herd_halve_{'xy'[dim]}", m.site(i, f"herd.{'xy'[dim]}"), text, eq)


def calls(m: Module):
    """External calls: deleted, two arguments of one type swapped, a scalar argument plus or
    minus one (a mask bound one position off, a block's column offset one element off)."""
    for i, line in enumerate(m.lines):
        c = _CALL.match(line)
        if not c:
            continue
        names, types = _names(c.group(3)), _split_types(c.group(4))
        yield Mutant("call_delete", m.site(i, f"call.{c.group(2)}"), m.delete(i))
        for a in range(len(names)):
            for b in range(a + 1, len(names)):
                if types[a] == types[b] and names[a] != names[b]:
                    swapped = list(names)
                    swapped[a], swapped[b] = swapped[b], swapped[a]
                    new = line[:c.start(3)] + ", ".join(swapped) + line[c.end(3):]
                    eq = ""
                    if any(c.group(2).startswith(p) and {a, b} == set(ab) for p, ab in SYMMETRIC_EXTERN_ARGS.items()):
                        eq = "the kernel is symmetric in these two arguments (see its source)"
                    yield Mutant("call_swap_args", m.site(i, f"call.{c.group(2)}.{a}-{b}"), m.replace(i, new), eq)
            if types[a] in ("i32", "index"):
                for op, what in (("arith.addi", "plus1"), ("arith.subi", "minus1")):
                    before = (f"{NEW}_c = arith.constant 1 : {types[a]}", f"{NEW}_v = {op} {names[a]}, {NEW}_c : {types[a]}")
                    new = _with_operand(line, c.start(3), c.end(3), names, a, f"{NEW}_v")
                    yield Mutant(f"call_scalar_{what}", m.site(i, f"call.{c.group(2)}.{a}"), m.replace(i, new, before))


def deletions(m: Module):
    """DMAs and fills deleted."""
    for i, line in enumerate(m.lines):
        if _DMA.match(line):
            yield Mutant("dma_delete", m.site(i, "dma"), m.delete(i))
        elif line.lstrip().startswith("linalg.fill"):
            yield Mutant("fill_delete", m.site(i, "fill"), m.delete(i))


def operands(m: Module):
    """Operands of binary arith ops and of two-input linalg.generics swapped."""
    for i, line in enumerate(m.lines):
        b = _BIN.match(line)
        if b and b.group(3) in BINARY and b.group(4) != b.group(5):
            indent, res, op, x, y, t = b.groups()
            eq = "commutative op" if op in COMMUTATIVE else ""
            yield Mutant("swap_operands", m.site(i, op), m.replace(i, f"{indent}{res} = {op} {y}, {x} : {t}"), eq)
        g = _INS.search(line)
        if g and "linalg.generic" in line:
            types = _split_types(g.group(3))
            if len(types) == 2 and types[0] == types[1]:
                new = line[:g.start(1)] + f"{g.group(2)}, {g.group(1)}" + line[g.end(2):]
                eq = "symmetric body: the two inputs enter it the same way" if _symmetric(m.lines, i) else ""
                yield Mutant("swap_generic_inputs", m.site(i, "generic"), m.replace(i, new), eq)


def predicates(m: Module):
    """Comparison predicates widened (< to <=) and inverted."""
    for i, line in enumerate(m.lines):
        c = _CMPI.match(line)
        if not c:
            continue
        pred = c.group(3)
        for kind, table in (("widen", WIDER), ("invert", NARROWER)):
            if pred not in table:
                continue
            new = line.replace(f"arith.cmpi {pred},", f"arith.cmpi {table[pred]},", 1)
            eq = ""
            if kind == "widen" and _guards_only_mask(m.lines, i, c.group(2)):
                eq = "widens the guard of a causal mask call: masking a tile wholly in the past changes nothing"
            yield Mutant(f"cmpi_{kind}", m.site(i, f"cmpi.{pred}"), m.replace(i, new), eq)


def constants(m: Module):
    """Index constants plus one; float constants plus one."""
    for i, line in enumerate(m.lines):
        c = _CONST.match(line)
        if not c or c.group(2).startswith(NEW):
            continue
        indent, name, value, t = c.groups()
        new_value = str(int(value) + 1) if t in ("index", "i32") else f"{float(value) + 1.0:e}"
        eq = ""
        if t == "index" and _plus1_changes_no_value(m, i, name, int(value)):
            eq = ("every use gives the same values: bounds of constant loops that run the same iterations, "
                  "a factor of a loop index that is only 0, or the stride of a unit DMA dimension at offset 0")
        yield Mutant(f"const_{'int' if t in ('index', 'i32') else 'float'}_plus1", m.site(i, f"const.{name}"),
                     m.replace(i, f"{indent}{name} = arith.constant {new_value} : {t}"), eq)


def arg_maps(m: Module):
    """Two kernel operands of a launch (function arguments of one type) swapped: a wrong arg map."""
    for i, line in enumerate(m.lines):
        la = _LAUNCH.match(line)
        if not la:
            continue
        names = _names(la.group(2))
        args = [k for k, n in enumerate(names) if n.startswith("%arg")]
        owner = m.owner[i]
        launch = next((l for l in m.group.launches if l.name == owner), None)
        slot_of = {f"%arg{j}": s for j, s in enumerate(m.group.slots)}
        for a in args:
            for b in args:
                if b <= a:
                    continue
                sa, sb = slot_of[names[a]], slot_of[names[b]]
                if (sa.storage_shape, sa.element_type) != (sb.storage_shape, sb.element_type):
                    continue
                swapped = list(names)
                swapped[a], swapped[b] = swapped[b], swapped[a]
                new = line[:la.start(2)] + ", ".join(swapped) + line[la.end(2):]
                eq = ""
                if launch and launch.op in COMMUTATIVE_LAUNCHES and {sa.name, sb.name} <= set(launch.reads):
                    eq = f"the two inputs of an `{launch.op}` launch: read alike, combined commutatively"
                yield Mutant("argmap_swap", m.site(i, f"launch.{sa.name}-{sb.name}"), m.replace(i, new), eq)


def positions(m: Module):
    """Values computed from a position the module loads at run time (an i32 scalar: the token's
    `pos`, a chunk's `start` or `q_start`), one up and one down: a live length, a chunk count,
    a mask bound or an append position one off, which reads or writes one position (or one
    chunk) too many or too few."""
    tainted: dict[str, str] = {}                    # value -> its type
    for i, line in enumerate(m.lines):
        load, cast, b = _LOAD.match(line), _CAST.match(line), _BIN.match(line)
        if load:
            name, t = load.group(2), "i32"
        elif cast and cast.group(3) in tainted:
            name, t = cast.group(2), cast.group(5)
        elif b and b.group(3) in ("arith.addi", "arith.muli", "arith.divui", "arith.remui", "arith.minui") \
                and (b.group(4) in tainted or b.group(5) in tainted):
            name, t = b.group(2), b.group(6)
        else:
            continue
        tainted[name] = t
        indent = re.match(r"^\s*", line).group(0)
        rhs = line.split("=", 1)[1].strip()
        for op, what in (("arith.addi", "plus1"), ("arith.subi", "minus1")):
            text = "\n".join(m.lines[:i] + [f"{indent}{NEW}_o = {rhs}", f"{indent}{NEW}_c = arith.constant 1 : {t}",
                                            f"{indent}{name} = {op} {NEW}_o, {NEW}_c : {t}"] + m.lines[i + 1:])
            yield Mutant(f"position_{what}", m.site(i, f"position.{name}"), text)


OPERATORS = (dma_patterns, loops, herds, calls, deletions, operands, predicates, constants, arg_maps, positions)


def mutants(text: str, group: KernelGroup, idle: set[tuple[str, int, int]] | None = None) -> list[Mutant]:
    """Every mutant of every operator, in the module's order."""
    m = Module(text, group)
    out = []
    for op in OPERATORS:
        out.extend(op(m, idle) if op is herds else op(m))
    return out


# ---- equivalence rules that read the body -----------------------------------------------------

_BODY_OP = re.compile(r"^\s*(%\S+) = ([\w.]+) (.*?) : .*$")


def _symmetric(lines: list[str], i: int) -> bool:
    """True if the generic starting at line `i` yields the same expression with its two inputs
    exchanged (commutative ops compared with sorted operands)."""
    head = re.match(r"^\s*\^bb0\((.*)\):$", lines[i + 1])
    if not head:
        return False
    args = [a.split(":")[0].strip() for a in head.group(1).split(",")]

    def build(swap: bool):
        env = {args[0]: ("in", 1 if swap else 0), args[1]: ("in", 0 if swap else 1)}
        env.update({a: ("out", k) for k, a in enumerate(args[2:])})
        for line in lines[i + 2:]:
            if line.strip().startswith("linalg.yield"):
                return tuple(env.get(x.strip(), x.strip()) for x in line.split(":")[0].split()[1:])
            b = _BODY_OP.match(line)
            if not b:
                return None
            res, op, rest = b.groups()
            ops = [env.get(x.strip(), x.strip()) for x in rest.split(",")]
            if op in COMMUTATIVE:
                ops = sorted(ops, key=repr)
            env[res] = (op, *ops)
        return None

    a, b = build(False), build(True)
    return a is not None and a == b


def _iterations(m: Module, lb: str, ub: str, st: str, name: str = "", value: int = 0) -> list[int] | None:
    """A constant-bounded loop's iteration values, with `name` read as `value`; None if a bound
    is not a constant."""
    vals = [value if x == name else m.const(x) for x in (lb, ub, st)]
    if None in vals or vals[2] <= 0:
        return None
    return list(range(*vals))


def _plus1_changes_no_value(m: Module, i: int, name: str, value: int) -> bool:
    """True if the index constant `name` (defined on line `i`) feeds, within its launch, only
    loop bounds whose iteration set stays the same at `value` + 1, products with a loop index
    whose only value is 0, and strides of unit DMA dimensions at offset 0. On the tiny shapes a
    Q4NX row is one block: the loop over its blocks runs once, at 0, and the block's byte
    stride multiplies nothing but 0; a GEMM core's W tile lands in L1 as one row of bytes."""
    owner = m.owner[i]
    token = re.compile(re.escape(name) + r"\b")
    scope = [k for k in range(len(m.lines)) if m.owner[k] == owner]
    if sum(1 for k in scope if (c := _CONST.match(m.lines[k])) and c.group(2) == name) != 1:
        return False
    loops = {f.group(2): f for k in scope if (f := _FOR.match(m.lines[k]))}
    uses = [k for k in scope if k != i and token.search(m.lines[k])]
    for k in uses:
        line = m.lines[k]
        f, b = _FOR.match(line), _BIN.match(line)
        if f:
            _, _, lb, ub, st = f.groups()
            before = _iterations(m, lb, ub, st)
            if before is None or before != _iterations(m, lb, ub, st, name, value + 1):
                return False
        elif b and b.group(3) == "arith.muli" and name in (b.group(4), b.group(5)):
            other = b.group(5) if b.group(4) == name else b.group(4)
            loop = loops.get(other)
            if loop is None or _iterations(m, *loop.groups()[2:]) != [0]:
                return False
        elif not _only_unit_strides(m, line, name):
            return False
    return bool(uses)


def _only_unit_strides(m: Module, line: str, name: str) -> bool:
    """True if `line` is a DMA that uses `name` only as the stride of a dimension of size 1 at
    offset 0 (one element, at the same address whatever the stride)."""
    d = _DMA.match(line)
    if not d:
        return False
    names, operands = _dma_operands(d)
    fields = {k: (kind, seg) for k, _, kind, _, seg in operands}
    uses = [k for k, n in enumerate(names) if n == name]
    return bool(uses) and all(k in fields and fields[k][0] == "stride" and _unit_stride(m, names, k, fields[k][1])
                              for k in uses)


def _guards_only_mask(lines: list[str], i: int, cond: str) -> bool:
    """True if `cond` is used only by an scf.if whose body calls only an attention mask kernel."""
    uses = [k for k, l in enumerate(lines) if k != i and re.search(re.escape(cond) + r"\b", l)]
    if len(uses) != 1 or not lines[uses[0]].strip().startswith(f"scf.if {cond}"):
        return False
    body = []
    for l in lines[uses[0] + 1:]:
        if l.strip() == "}":
            break
        body.append(l.strip())
    calls = [l for l in body if l.startswith("func.call")]
    return len(calls) == 1 and "@attn_mask_" in calls[0] and all(
        l.startswith(("func.call", "%")) and ("arith.index_cast" in l or l.startswith("func.call")) for l in body)


__all__ = ["Module", "Mutant", "OPERATORS", "mutants"]
