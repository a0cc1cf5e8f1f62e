"""The text stitcher: many single-launch modules → one function with one `air.launch` per launch.

Why text: the sub-modules call external kernels from inside AIR regions, which an MLIR parser
without the AIR dialect rejects, and aircc reads text anyway. The stitcher therefore works on
the few syntactic facts it needs and leaves checking to `mlir_validate`:

- every SSA value, `#alias` and non-external symbol of a part gets the part's prefix
  (`%c0` → `%q_gemm_c0`, `@herd` / `sym_name = "herd"` → `q_gemm_herd`), external kernel
  symbols (the `func.func private` declarations) keep their names;
- a part's function arguments become the combined function's arguments through its
  `arg_map` (combined index per sub-module argument), which `stitch_group` derives from the
  group declaration: combined arguments are the group's slots in order;
- a function body that is a bare `air.herd` is wrapped in an `air.launch` and `air.segment`
  that forward every argument, so every part contributes exactly one launch;
- external declarations are merged by symbol: identical types, and one object for `link_with`.

Anything that would make the result silently wrong is a `StitchError`: an argument without a
destination, a slot index out of range, a combined argument no part uses, names that would
collide, a symbol that is neither defined nor declared.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from llama_base.group_contract import KernelGroup
from kernel_builder.mlir.common import slot_type

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SSA = re.compile(r"%([A-Za-z_$.\-][\w$.\-]*|\d+)")
_ALIAS = re.compile(r"#([A-Za-z_][\w$.]*)")
_SYMBOL = re.compile(r"@([A-Za-z_$.\-][\w$.\-]*)")
_SYM_NAME_TAIL = re.compile(r"sym_name\s*=\s*$")
_LINK_WITH = re.compile(r'link_with\s*=\s*"([^"]*)"')


class StitchError(ValueError):
    """The parts cannot be combined into a module that means what the declaration says."""


@dataclass(frozen=True)
class Part:
    prefix: str                  # unique per part; the launch name for a group
    text: str                    # a complete single-launch (or bare-herd) module
    arg_map: tuple[int, ...]     # combined-argument index of each of the module's arguments


@dataclass
class _Extern:
    symbol: str
    signature: str               # argument types and results, names stripped, spaces normalised
    link_with: str | None
    text: str


@dataclass
class _Module:
    aliases: dict[str, str]      # alias name (no '#') -> definition right-hand side
    decls: list[str]             # other top-level ops (channels, globals)
    externs: list[_Extern]
    func_name: str
    args: list[tuple[str, str]]  # (ssa name without '%', type)
    body: str


# ---- scanning ----------------------------------------------------------------------------
def _skip_string(text: str, i: int) -> int:
    m = _STRING.match(text, i)
    if not m:
        raise StitchError(f"unterminated string literal near: {text[i:i + 40]!r}")
    return m.end()


def _strip_comments(text: str) -> str:
    if "//" not in text:          # what the builders emit: nothing to strip
        return text
    out, i = [], 0
    while i < len(text):
        if text[i] == '"':
            j = _skip_string(text, i)
            out.append(text[i:j])
            i = j
        elif text.startswith("//", i):
            i = text.find("\n", i) if "\n" in text[i:] else len(text)
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _matching(text: str, i: int) -> int:
    """Index of the bracket closing the one at `i`, skipping string literals."""
    pairs = {"(": ")", "[": "]", "{": "}", "<": ">"}
    stack = [pairs[text[i]]]
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == '"':
            j = _skip_string(text, j)
            continue
        if c in "([{" or (c == "<" and stack[-1] == ">"):
            stack.append(pairs[c])
        elif c == "-" and text.startswith("->", j):
            j += 2
            continue
        elif c == stack[-1]:
            stack.pop()
            if not stack:
                return j
        j += 1
    raise StitchError(f"unbalanced {text[i]!r} near: {text[i:i + 40]!r}")


def _split_top(text: str, sep: str) -> list[str]:
    """Split at `sep` outside brackets and strings (a newline separates statements)."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            i = _skip_string(text, i)
            continue
        if c in "([{<" and not (c == "<" and sep == "\n"):
            depth += 1
        elif c in ")]}>" and not (c == ">" and (sep == "\n" or text[i - 1] == "-")):
            depth -= 1
        elif c == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
        i += 1
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]


# ---- parsing a part ----------------------------------------------------------------------
_FUNC = re.compile(r"func\.func\s+(private\s+)?@([A-Za-z_$.\-][\w$.\-]*)\s*\(")


def _parse_func(stmt: str) -> tuple[bool, str, list[str], str]:
    """(is_private, name, argument texts, rest after the argument list)."""
    m = _FUNC.match(stmt)
    if not m:
        raise StitchError(f"not a func.func: {stmt[:60]!r}")
    close = _matching(stmt, m.end() - 1)
    return bool(m.group(1)), m.group(2), _split_top(stmt[m.end():close], ","), stmt[close + 1:].strip()


def _take_type(text: str) -> tuple[str, str]:
    """Split one type (e.g. `memref<4xbf16, 2 : i32>`, `(i32, f32)`) off the front of `text`."""
    if text.startswith("("):
        close = _matching(text, 0)
        return text[:close + 1], text[close + 1:].strip()
    m = re.match(r"[!\w.$]+", text)
    if not m:
        raise StitchError(f"expected a type at {text[:40]!r}")
    end = m.end()
    if text[end:end + 1] == "<":
        end = _matching(text, end) + 1
    return text[:end], text[end:].strip()


def _parse_extern(stmt: str) -> _Extern:
    _, name, args, rest = _parse_func(stmt)
    types = [a.split(":", 1)[1].strip() if a.startswith("%") else a for a in args]
    results = ""
    if rest.startswith("->"):
        results, rest = _take_type(rest[2:].strip())
    link = None
    if rest.startswith("attributes"):
        brace = rest.index("{")
        close = _matching(rest, brace)
        lm = _LINK_WITH.search(rest[brace:close + 1])
        link = lm.group(1) if lm else None
        rest = rest[close + 1:].strip()
    if rest:
        raise StitchError(f"@{name}: a private function must be a declaration (no body)")
    sig = re.sub(r"\s+", " ", f"({', '.join(types)}) -> {results or '()'}")
    return _Extern(name, sig, link, stmt.strip())


_OP_NAME = re.compile(r'(?:%[^=]*=\s*)?("[\w.$]+"|[\w.$]+)')


def _op_name(stmt: str) -> str:
    m = _OP_NAME.match(stmt)
    return m.group(1).strip('"') if m else ""


def _parse_module(text: str) -> _Module:
    text = _strip_comments(text)
    m = re.search(r"^\s*module\b[^{]*\{", text, re.M)
    if not m:
        raise StitchError("no `module {` in part")
    aliases: dict[str, str] = {}
    for line in _split_top(text[:m.start()], "\n"):
        am = re.fullmatch(r"#([A-Za-z_][\w$.]*)\s*=\s*(.+)", line, re.S)
        if not am:
            raise StitchError(f"unexpected text before the module: {line[:60]!r}")
        aliases[am.group(1)] = am.group(2).strip()
    close = _matching(text, m.end() - 1)
    if text[close + 1:].strip():
        raise StitchError("text after the module's closing brace")
    decls, externs, funcs = [], [], []
    for stmt in _split_top(text[m.end():close], "\n"):
        if stmt.startswith("func.func"):
            (externs if _FUNC.match(stmt).group(1) else funcs).append(stmt)
        elif stmt.startswith(('"air.channel"', "air.channel ", "memref.global")):
            decls.append(stmt)
        else:
            raise StitchError(f"unsupported top-level op in part: {stmt[:60]!r}")
    if len(funcs) != 1:
        raise StitchError(f"a part needs exactly one public function, found {len(funcs)}")
    _, name, arg_texts, rest = _parse_func(funcs[0])
    args = []
    for a in arg_texts:
        am = re.fullmatch(r"%([\w$.\-]+)\s*:\s*(.+)", a, re.S)
        if not am:
            raise StitchError(f"@{name}: argument {a!r} is not `%name: type`")
        args.append((am.group(1), am.group(2).strip()))
    if rest.startswith("->"):
        raise StitchError(f"@{name}: a launch function returns nothing")
    if rest.startswith("attributes"):
        rest = rest[_matching(rest, rest.index("{")) + 1:].strip()
    if not rest.startswith("{"):
        raise StitchError(f"@{name}: function has no body")
    body = rest[1:_matching(rest, 0)]
    stmts = _split_top(body, "\n")
    if not stmts or not re.fullmatch(r"(func\.)?return", stmts[-1]):
        raise StitchError(f"@{name}: the body must end in a plain `return`")
    body = body[:body.rindex(stmts[-1].split()[0])]
    return _Module(aliases, decls, [_parse_extern(e) for e in externs], name, args, body)


def _wrap_bare_herd(mod: _Module) -> None:
    """Give a function whose body is a bare herd the launch and segment every part must have."""
    stmts = _split_top(mod.body, "\n")
    generic = [_op_name(st) for st in stmts if re.match(r'(%[^=]*=\s*)?"', st)]
    if any(re.match(r"(%[^=]*=\s*)?air\.", st) for st in stmts):
        raise StitchError(f"@{mod.func_name}: AIR ops must be written in generic form")
    if "air.launch" in generic or "air.herd" not in generic:
        return
    used = {m.group(1) for m in _SSA.finditer(mod.body)}
    taken = _defined_symbols(mod)

    def unique(stem: str, pool: set[str]) -> str:
        n = stem
        while n in pool:
            n += "_w"
        pool.add(n)
        return n

    lnames = [unique(f"wrap_launch_arg{i}", used) for i in range(len(mod.args))]
    snames = [unique(f"wrap_segment_arg{i}", used) for i in range(len(mod.args))]
    position = {a: i for i, (a, _) in enumerate(mod.args)}
    inner = _rename(mod.body, lambda n: snames[position[n]] if n in position else n,
                    lambda a: a, lambda n: n)
    types = ", ".join(t for _, t in mod.args)

    def block(names: list[str]) -> str:
        typed = ", ".join(f"%{x}: {t}" for x, (_, t) in zip(names, mod.args))
        return f"^bb0({typed}):" if typed else "^bb0:"

    def attrs(kind: str) -> str:
        return (f'{{operandSegmentSizes = array<i32: 0, 0, {len(mod.args)}>, '
                f'sym_name = "{unique(kind, taken)}"}} : ({types}) -> ()')

    mod.body = "\n".join([
        f'"air.launch"({", ".join("%" + a for a, _ in mod.args)}) ({{',
        block(lnames),
        f'"air.segment"({", ".join("%" + x for x in lnames)}) ({{',
        block(snames),
        inner,
        '"air.segment_terminator"() : () -> ()',
        "}) " + attrs("segment"),
        '"air.launch_terminator"() : () -> ()',
        "}) " + attrs("launch"),
    ])


# ---- renaming ----------------------------------------------------------------------------
def _rename(text: str, ssa: Callable[[str], str], alias: Callable[[str], str],
            symbol: Callable[[str], str]) -> str:
    """Apply the three name maps outside string literals, and `symbol` to `sym_name` strings."""
    out, pos = [], 0
    for m in _STRING.finditer(text):
        code = text[pos:m.start()]
        out.append(_rename_code(code, ssa, alias, symbol))
        lit = m.group(0)
        if _SYM_NAME_TAIL.search(code):
            lit = '"' + symbol(lit[1:-1]) + '"'
        out.append(lit)
        pos = m.end()
    out.append(_rename_code(text[pos:], ssa, alias, symbol))
    return "".join(out)


def _rename_code(code: str, ssa, alias, symbol) -> str:
    code = _SSA.sub(lambda m: "%" + ssa(m.group(1)), code)
    code = _ALIAS.sub(lambda m: "#" + alias(m.group(1)), code)
    return _SYMBOL.sub(lambda m: "@" + symbol(m.group(1)), code)


def _defined_symbols(mod: _Module) -> set[str]:
    defs = {mod.func_name}
    for text in mod.decls + [mod.body]:
        for m in _STRING.finditer(text):
            if _SYM_NAME_TAIL.search(text[:m.start()]):
                defs.add(m.group(0)[1:-1])
        for d in re.finditer(r"(?:air\.channel|memref\.global[^@]*)\s+@([\w$.\-]+)", text):
            defs.add(d.group(1))
    return defs


# ---- stitching ---------------------------------------------------------------------------
def stitch(func_name: str, arg_types: Sequence[str], parts: Sequence[Part]) -> str:
    """One module whose function `func_name(arg_types...)` runs the parts' launches in order."""
    if len({p.prefix for p in parts}) != len(parts):
        raise StitchError("colliding names: two parts share a prefix")
    externs: dict[str, _Extern] = {}
    alias_lines, decls, bodies = [], [], []
    owners: dict[str, str] = {}   # renamed name -> prefix of the part that defines it
    combined = {f"%arg{i}" for i in range(len(arg_types))}
    referenced: set[int] = set()
    for part in parts:
        mod = _parse_module(part.text)
        where = f"part {part.prefix!r} (@{mod.func_name})"
        if len(part.arg_map) < len(mod.args):
            lost = ", ".join("%" + a for a, _ in mod.args[len(part.arg_map):])
            raise StitchError(f"{where}: argument {lost} lands nowhere (no combined argument mapped)")
        if len(part.arg_map) > len(mod.args):
            raise StitchError(f"{where}: {len(part.arg_map)} map entries for {len(mod.args)} arguments")
        for (name, t), idx in zip(mod.args, part.arg_map):
            if not 0 <= idx < len(arg_types):
                raise StitchError(f"{where}: %{name} maps to slot {idx}, out of range 0..{len(arg_types) - 1}")
            if t != arg_types[idx]:
                raise StitchError(f"{where}: %{name} is {t} but combined argument {idx} is {arg_types[idx]}")
        used = {m.group(1) for m in _SSA.finditer(mod.body)}
        for name, _ in mod.args:
            if name not in used:
                raise StitchError(f"{where}: argument %{name} lands nowhere (unused in the body)")
        referenced.update(part.arg_map)
        _wrap_bare_herd(mod)

        arg_names = {name: f"arg{idx}" for (name, _), idx in zip(mod.args, part.arg_map)}
        ext_syms = {e.symbol for e in mod.externs}
        local_syms = _defined_symbols(mod) - ext_syms
        pre = part.prefix + "_"
        renamed_ssa: set[str] = set()

        def ssa(n: str) -> str:
            out = arg_names.get(n) or pre + n
            if n not in arg_names:
                renamed_ssa.add("%" + out)
            return out

        def alias(n: str) -> str:
            return pre + n if n in mod.aliases else n

        def symbol(n: str) -> str:
            if n in local_syms:
                return pre + n
            if n in ext_syms:
                return n
            raise StitchError(f"{where}: @{n} is neither defined in the part nor declared external")

        body = _rename(mod.body, ssa, alias, symbol)
        part_decls = [_rename(d, ssa, alias, symbol) for d in mod.decls]
        names = renamed_ssa | {"#" + pre + a for a in mod.aliases} | {"@" + pre + s for s in local_syms}
        for n in names:
            if n in owners or n in combined:
                raise StitchError(f"colliding names: {n} from part {part.prefix!r} "
                                  f"also comes from part {owners.get(n, '<combined arguments>')!r}")
            owners[n] = part.prefix
        alias_lines += [f"#{pre}{a} = {_rename(v, ssa, alias, symbol)}" for a, v in mod.aliases.items()]
        decls += part_decls
        bodies.append(_reindent(body, 4))
        for e in mod.externs:
            _merge_extern(externs, e, where)

    missing = [i for i in range(len(arg_types)) if i not in referenced]
    if missing:
        raise StitchError(f"combined argument(s) {missing} are referenced by no part")
    args = ", ".join(f"%arg{i}: {t}" for i, t in enumerate(arg_types))
    lines = alias_lines + ["module {"] + [f"  {d}" for d in decls]
    lines += [f"  func.func @{func_name}({args}) {{"] + bodies + ["    return", "  }"]
    lines += [f"  {e.text}" for e in externs.values()] + ["}"]
    return "\n".join(lines) + "\n"


def _merge_extern(known: dict[str, _Extern], e: _Extern, where: str) -> None:
    old = known.get(e.symbol)
    if old is None:
        known[e.symbol] = e
        return
    if old.signature != e.signature:
        raise StitchError(f"{where}: @{e.symbol} declared as {e.signature}, elsewhere as {old.signature}")
    if old.link_with and e.link_with and old.link_with != e.link_with:
        raise StitchError(f"{where}: @{e.symbol} links {e.link_with}, elsewhere {old.link_with}")
    if e.link_with and not old.link_with:
        known[e.symbol] = e


def _reindent(text: str, indent: int) -> str:
    lines = [ln.rstrip() for ln in text.split("\n") if ln.strip()]
    cut = min((len(ln) - len(ln.lstrip()) for ln in lines), default=0)
    return "\n".join(" " * indent + ln[cut:] for ln in lines)


def slot_types(group: KernelGroup) -> list[str]:
    """Combined-function argument types: the group's slots in declaration order, as L3 memrefs."""
    return [slot_type(s) for s in group.slots]


def stitch_group(group: KernelGroup, texts: Sequence[str]) -> str:
    """Stitch one sub-module per launch (in `group.launches` order) with maps from the declaration."""
    if len(texts) != len(group.launches):
        raise StitchError(f"{group.name}: {len(texts)} modules for {len(group.launches)} launches")
    parts = []
    for launch, text in zip(group.launches, texts):
        try:
            arg_map = tuple(group.index(a) for a in launch.args)
        except KeyError as e:
            raise StitchError(f"{group.name}: launch {launch.name!r}: {e.args[0]}") from None
        parts.append(Part(launch.name, text, arg_map))
    return stitch(group.name, slot_types(group), parts)
