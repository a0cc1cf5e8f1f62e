"""Peano builds of the external C++ kernels into the objects MLIR's `link_with` names.

Which objects a set of groups needs comes from `externs.externs_for_launch`, the same
mapping the MLIR builders declare from, so a declared symbol always has an object. Symbols
that share a `link_object` (the primitives one herd calls) are compiled one translation
unit each and joined into that object by a relocatable link (`ld.lld -r`), because a herd
names one object. Each object is rebuilt only when its stamp changes: a hash of the source and every local header
it includes, the `-D` defines, the flags, the compiler's `--version` and the AIE API headers.
Peano and the AIE API headers come from GitHub releases (the `llvm-aie` and `mlir_aie`
wheels), so a machine without them gets one "skipped" result per object naming what to
install, and the simulated device, which runs reference kernels, never needs the objects.

Command line: `python -m kernel_builder.external_kernels OUT_DIR [--config config.json]`.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from filelock import FileLock

from kernel_builder.externs import ExternKernel, externs_for_launch

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"

ENV_PEANO = "PEANO_INSTALL_DIR"
ENV_MLIR_AIE = "MLIR_AIE_INSTALL_DIR"
PEANO_TARGET = "aie2p-none-unknown-elf"
# Peano predefines __AIENGINE__, on which aie_api/aie.hpp includes its ADF graph wrappers, and
# those need Vitis' adf.h, which no Peano install has; defining that header's include guard
# keeps it out. The warnings are the ones mlir-aie's own kernel builds silence for the headers.
ADF_GUARD = "-D__AIE_API_AIE_ADF_HPP__"
PEANO_FLAGS = (
    "-O2", "-std=c++20", f"--target={PEANO_TARGET}", "-DNDEBUG", ADF_GUARD,
    "-Wno-parentheses", "-Wno-attributes", "-Wno-macro-redefined", "-Wno-empty-body",
    "-Wno-missing-template-arg-list-after-template-kw",
)
AIE_API_HEADER = Path("aie_api") / "aie.hpp"

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class ToolchainNotFound(Exception):
    """Peano or the AIE API headers are not installed; the message says what to set."""


@dataclass(frozen=True)
class Toolchain:
    """A C++ compiler and how this project calls it for the kernels."""

    cxx: Path
    flags: tuple[str, ...]
    include_dirs: tuple[Path, ...] = ()

    def compile_command(self, kernel: ExternKernel, source: Path, out: Path) -> list[str]:
        incs = [f"-I{d}" for d in self.include_dirs]
        return [str(self.cxx), *self.flags, *incs, *define_flags(kernel), "-c", str(source), "-o", str(out)]

    @property
    def linker(self) -> Path:
        """LLVM's linker from the compiler's own bin folder (Peano ships it beside clang++)."""
        return self.cxx.parent / "ld.lld"

    def bundle_command(self, units: Iterable[Path], out: Path) -> list[str]:
        """Join translation units into one relocatable object: the one a herd's link_with names."""
        return [str(self.linker), "-r", *(str(u) for u in units), "-o", str(out)]


def peano_toolchain(root: Path, aie_include: Path) -> Toolchain:
    """How the build calls a Peano install: a function of its paths only, so the exact command
    line can be checked on a machine without Peano."""
    return Toolchain(Path(root) / "bin" / "clang++", PEANO_FLAGS, (Path(aie_include),))


def define_flags(kernel: ExternKernel) -> list[str]:
    return [f"-D{name}={value}" for name, value in kernel.defines]


def _dist_file(dist: str, rel: str) -> Path | None:
    try:
        p = Path(importlib.metadata.distribution(dist).locate_file(rel))
    except importlib.metadata.PackageNotFoundError:
        return None
    return p if p.exists() else None


def _peano_root() -> Path:
    env = os.environ.get(ENV_PEANO)
    if env:
        root = Path(env).expanduser()
        if not (root / "bin" / "clang++").is_file():
            raise ToolchainNotFound(f"{ENV_PEANO}={env} has no bin/clang++")
        return root
    # The llvm-aie wheel installs the toolchain as a data folder, not an importable package.
    wheel = _dist_file("llvm-aie", "llvm-aie")
    if wheel is not None and (wheel / "bin" / "clang++").is_file():
        return wheel
    on_path = shutil.which("clang++")
    if on_path and _targets_aie2p(on_path):
        return Path(on_path).resolve().parent.parent
    raise ToolchainNotFound(f"Peano (llvm-aie) not found; set {ENV_PEANO}")


def _targets_aie2p(cxx: str) -> bool:
    """A clang on PATH is usually the host's; only Peano registers the AIE targets."""
    try:
        out = subprocess.run([cxx, "--print-targets"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return re.search(r"^\s*aie2p\s", out, re.MULTILINE) is not None


def _aie_api_include(peano_root: Path) -> Path:
    candidates: list[Path] = []
    env = os.environ.get(ENV_MLIR_AIE)
    if env:
        candidates.append(Path(env).expanduser() / "include")
    spec = importlib.util.find_spec("mlir_aie")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "include" for p in spec.submodule_search_locations]
    # Both wheels unpack side by side in one site-packages.
    candidates.append(peano_root.parent / "mlir_aie" / "include")
    for c in candidates:
        if (c / AIE_API_HEADER).is_file():
            return c
    raise ToolchainNotFound(
        f"AIE API headers ({AIE_API_HEADER}) not found; install mlir_aie or set {ENV_MLIR_AIE}")


def find_peano() -> Toolchain:
    """Peano's clang++ with the AIE API include dir; raises ToolchainNotFound saying what is missing.

    Looks at $PEANO_INSTALL_DIR, then the `llvm-aie` wheel, then a clang++ on PATH that
    registers the aie2p target.
    """
    root = _peano_root()
    return peano_toolchain(root, _aie_api_include(root))


def source_closure(source: Path) -> list[Path]:
    """The source and every header it reaches through `#include "..."`, each once."""
    seen: list[Path] = []
    todo = [source.resolve()]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        for name in _INCLUDE.findall(p.read_text()):
            dep = (p.parent / name).resolve()
            if dep.is_file():
                todo.append(dep)
    return seen


@lru_cache(maxsize=None)
def _compiler_version(cxx: str, mtime_ns: int) -> str:
    """`mtime_ns` is only part of the cache key: a reinstalled compiler is asked again."""
    res = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise ToolchainNotFound(f"{cxx} --version failed: {res.stderr.strip() or res.returncode}")
    return res.stdout.strip()


def compiler_version(cxx: Path | str) -> str:
    path = shutil.which(str(cxx)) or str(cxx)
    return _compiler_version(path, os.stat(path).st_mtime_ns)


def _tree_signature(root: Path) -> list[tuple[str, int, int]]:
    """Names, sizes and mtimes under an include dir: a header update changes the objects,
    and hashing every header's bytes on each build would cost more than the check saves."""
    sig = []
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            st = os.stat(os.path.join(dirpath, f))
            sig.append((os.path.relpath(os.path.join(dirpath, f), root), st.st_size, st.st_mtime_ns))
    return sorted(sig)


def stamp(kernel: ExternKernel, toolchain: Toolchain, kernels_dir: Path = KERNELS_DIR) -> str:
    h = hashlib.sha256()
    for p in source_closure(kernels_dir / kernel.source):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    meta = {
        "defines": [list(d) for d in kernel.defines],
        "flags": list(toolchain.flags),
        "compiler": compiler_version(toolchain.cxx),
        "includes": {str(d): _tree_signature(d) for d in toolchain.include_dirs},
    }
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class KernelObject:
    """One object file `link_with` names, and the kernels (one translation unit each) in it."""

    name: str
    kernels: tuple[ExternKernel, ...]

    @property
    def bundled(self) -> bool:
        return len(self.kernels) > 1 or self.kernels[0].link_object != self.kernels[0].obj

    def stamp(self, toolchain: Toolchain, kernels_dir: Path = KERNELS_DIR) -> str:
        if not self.bundled:
            return stamp(self.kernels[0], toolchain, kernels_dir)
        parts = [stamp(k, toolchain, kernels_dir) for k in self.kernels]
        return hashlib.sha256(json.dumps(["bundle", str(toolchain.linker), parts]).encode()).hexdigest()


def objects_for(kernels: Iterable[ExternKernel]) -> list[KernelObject]:
    """The kernels grouped by the object that links them, in first-use order."""
    by_obj: dict[str, list[ExternKernel]] = {}
    for k in kernels:
        members = by_obj.setdefault(k.link_object, [])
        if all(m.symbol != k.symbol for m in members):
            members.append(k)
    return [KernelObject(name, tuple(ks)) for name, ks in by_obj.items()]


@dataclass(frozen=True)
class BuildResult:
    symbol: str        # the symbols in the object, comma-separated
    obj: Path
    status: str        # "built", "up-to-date" or "skipped"
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.obj.name}: {self.status}" + (f": {self.reason}" if self.reason else "")


def externs_for_groups(groups: Iterable) -> list[ExternKernel]:
    """Every external kernel the groups' launches call, each symbol once, in first-use order."""
    out: dict[str, ExternKernel] = {}
    for g in groups:
        for launch in g.launches:
            for k in externs_for_launch(launch):
                if out.setdefault(k.symbol, k) != k:
                    raise ValueError(f"symbol {k.symbol} is declared twice with different definitions")
    return list(out.values())


def _run_tool(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(cmd)}):\n{res.stderr}")


def _build_one(target: KernelObject, out_dir: Path, tc: Toolchain, kernels_dir: Path) -> BuildResult:
    obj = out_dir / target.name
    symbols = ",".join(k.symbol for k in target.kernels)
    stamp_file = obj.with_name(obj.name + ".stamp")
    want = target.stamp(tc, kernels_dir)
    if obj.is_file() and stamp_file.is_file() and stamp_file.read_text().strip() == want:
        return BuildResult(symbols, obj, "up-to-date")
    tmp = obj.with_name(f".{obj.name}.{os.getpid()}.tmp")
    units = [tmp] if not target.bundled else \
        [obj.with_name(f".{k.obj}.{os.getpid()}.unit") for k in target.kernels]
    try:
        for k, unit in zip(target.kernels, units):
            _run_tool(tc.compile_command(k, kernels_dir / k.source, unit), f"compiling {k.symbol}")
        if target.bundled:
            _run_tool(tc.bundle_command(units, tmp), f"bundling {target.name}")
        if not tmp.is_file():
            raise RuntimeError(f"building {target.name} wrote no object")
        # Stamp last: a crash between the two leaves an object without a stamp, which rebuilds.
        os.replace(tmp, obj)
        stamp_file.write_text(want + "\n")
    finally:
        for u in [tmp, *units]:
            u.unlink(missing_ok=True)
    return BuildResult(symbols, obj, "built")


def build_objects(kernels: Iterable[ExternKernel], out_dir: Path, toolchain: Toolchain | None = None,
                  kernels_dir: Path = KERNELS_DIR) -> list[BuildResult]:
    """Build each object the kernels' `link_with` names into `out_dir` unless its stamp is unchanged.

    One result per object. `toolchain` defaults to `find_peano()`; when that fails every
    result is "skipped" with its reason. A compile error raises RuntimeError with the command
    and compiler output.
    """
    targets = objects_for(kernels)
    out_dir = Path(out_dir)
    if toolchain is None:
        try:
            toolchain = find_peano()
        except ToolchainNotFound as e:
            return [BuildResult(",".join(k.symbol for k in t.kernels), out_dir / t.name, "skipped", str(e))
                    for t in targets]
    out_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir / ".build.lock")):
        return [_build_one(t, out_dir, toolchain, kernels_dir) for t in targets]


def build_group_objects(groups: Iterable, out_dir: Path, toolchain: Toolchain | None = None) -> list[BuildResult]:
    return build_objects(externs_for_groups(groups), out_dir, toolchain)


def main(argv: list[str] | None = None) -> int:
    from kernel_builder.groups import all_groups, prefill_buckets
    from llama_base.config import LlamaConfig
    from llama_base.errors import UserError

    ap = argparse.ArgumentParser(description="Build the external kernel objects every kernel group links.")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--config", type=Path, help="a checkpoint's config.json or folder (default: Llama-3.2-1B)")
    args = ap.parse_args(argv)
    try:
        cfg = LlamaConfig.from_json(args.config) if args.config else LlamaConfig()
        results = build_group_objects(all_groups(cfg, prefill_buckets(cfg)), args.out_dir)
    except (RuntimeError, UserError) as e:
        print(e, file=sys.stderr)
        return 1
    for r in results:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
