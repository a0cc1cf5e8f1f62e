"""A group's MLIR-AIR module, and its ELF where aircc exists.

The pipeline is split at the two places a cache wants to cut it:
- `compile_group_mlir(group) -> str` is a pure function of the declaration and the builder
  sources: build one module per launch, stitch, validate (parse + structural checks +
  cross-check against the declaration). No files, no toolchain.
- `compile_elf(mlir_path, out_dir, group)` runs aircc with the group's options on a written
  module. It needs the toolchain (`toolchain()` finds it) and the kernel objects named by
  the module's `link_with` attributes.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kernel_builder.external_kernels import ToolchainNotFound, build_group_objects, find_peano
from llama_base.group_contract import KernelGroup
from kernel_builder.mlir import build_launch
from llama_base.paths import kernel_objects_dir
from multi_launch_builder.mlir_validate import validate_group_module
from multi_launch_builder.stitching import stitch_group


class ToolchainError(RuntimeError):
    """aircc is missing, or it failed, or the objects it must link are absent."""


def assemble(group: KernelGroup) -> str:
    """The group's stitched module, not yet validated. Every group is built the same way: one
    module per launch (its `op` picks the builder), stitched with argument maps taken from the
    declaration, so adding a launch to a group in `groups.py` needs no change here."""
    return stitch_group(group, [build_launch(group, launch) for launch in group.launches])


def compile_group_mlir(group: KernelGroup) -> str:
    """The group's stitched, validated module text (raises on any inconsistency)."""
    text = assemble(group)
    validate_group_module(text, group)
    return text


@dataclass(frozen=True)
class Toolchain:
    aircc: Path | None
    aiecc: Path | None
    peano: Path | None       # Peano (llvm-aie) install root, the one holding bin/clang

    @property
    def complete(self) -> bool:
        return None not in (self.aircc, self.aiecc, self.peano)

    def missing(self) -> list[str]:
        names = {"aircc": self.aircc, "aiecc": self.aiecc, "Peano (PEANO_INSTALL_DIR)": self.peano}
        return [n for n, p in names.items() if p is None]

    def stamp(self) -> str:
        """Identifies the toolchain for cache keys: which binaries, and when they changed."""
        parts = []
        for name, p in (("aircc", self.aircc), ("aiecc", self.aiecc), ("peano", self.peano)):
            parts.append(f"{name}={p}@{int(p.stat().st_mtime)}" if p and p.exists() else f"{name}=none")
        return ";".join(parts)


def toolchain() -> Toolchain:
    """aircc and aiecc from PATH (the C++ drivers or the older .py ones); Peano from
    PEANO_INSTALL_DIR, else wherever the kernel-object build finds it (the llvm-aie wheel)."""
    def find(*names: str) -> Path | None:
        for n in names:
            hit = shutil.which(n)
            if hit:
                return Path(hit)
        return None

    peano: Path | None = None
    env = os.environ.get("PEANO_INSTALL_DIR")
    if env and (Path(env) / "bin" / "clang").exists():
        peano = Path(env)
    elif not env:
        try:
            peano = find_peano().cxx.parent.parent
        except ToolchainNotFound:
            peano = None
    return Toolchain(find("aircc", "aircc.py"), find("aiecc", "aiecc.py"), peano)


def link_objects(mlir_text: str) -> list[str]:
    """Object files the module's external kernel declarations name, in first-use order."""
    seen: list[str] = []
    for obj in re.findall(r'link_with\s*=\s*"([^"]+)"', mlir_text):
        if obj not in seen:
            seen.append(obj)
    return seen


def aircc_command(tc: Toolchain, mlir_path: Path, out_dir: Path, group: KernelGroup) -> list[str]:
    opts = dict(group.options)
    fmt = opts.get("output_format", "elf")
    cmd = [str(tc.aircc), str(mlir_path), f"--device={opts.get('device', 'npu2')}",
           f"--output-format={fmt}", f"--tmpdir={out_dir / f'{group.name}.prj'}", f"--peano={tc.peano}"]
    if opts.get("omit_while_true_loop"):
        cmd.append("--omit-while-true-loop")
    if fmt == "elf":
        cmd.append(f"--elf-name={out_dir / f'{group.name}.elf'}")
    else:
        cmd += ["-o", str(out_dir / f"{group.name}.xclbin"), "-i", str(out_dir / f"{group.name}.insts.bin")]
    return cmd


def default_objects_dir() -> Path:
    """Kernel objects are shared by every group and every KernelCache entry, so they live once."""
    return kernel_objects_dir()


def compile_elf(mlir_path: Path, out_dir: Path, group: KernelGroup, objects_dir: Path | None = None,
                tc: Toolchain | None = None) -> dict[str, Path | str]:
    """Run aircc on `mlir_path` with the group's options.

    Returns the artifacts by kind: for the ELF format `elf` (the path) and `kernel` (the name
    XRT opens it by, `main:<function>`); for xclbin, `xclbin` and `insts`. The kernel objects
    the module's `link_with` names are built into `objects_dir` when missing (stamped, see
    `external_kernels`) and linked into aircc's working directories, where aiecc looks.
    """
    tc = tc or toolchain()
    if not tc.complete:
        raise ToolchainError(f"cannot compile {group.name}: missing {', '.join(tc.missing())}")
    mlir_path, out_dir = Path(mlir_path).resolve(), Path(out_dir).resolve()
    objects_dir = Path(objects_dir or default_objects_dir()).resolve()
    prj = out_dir / f"{group.name}.prj"
    prj.mkdir(parents=True, exist_ok=True)
    objs = link_objects(mlir_path.read_text())
    if any(not (objects_dir / o).exists() for o in objs):
        skipped = [r for r in build_group_objects([group], objects_dir) if r.status == "skipped"]
        if skipped:
            raise ToolchainError(f"{group.name}: kernel objects not built: {skipped[0].reason}")
    absent = [o for o in objs if not (objects_dir / o).exists()]
    if absent:
        raise ToolchainError(f"{group.name}: the module links {', '.join(absent)}, absent from {objects_dir}")
    for o in objs:
        for where in (out_dir, prj):
            dest = where / o
            if not dest.exists():
                dest.symlink_to(objects_dir / o)
    cmd = aircc_command(tc, mlir_path, out_dir, group)
    run = subprocess.run(cmd, cwd=out_dir, capture_output=True, text=True)
    if run.returncode != 0:
        tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-20:])
        raise ToolchainError(f"aircc failed on {group.name} ({run.returncode}):\n{tail}")
    fmt = dict(group.options).get("output_format", "elf")
    produced: dict[str, Path | str] = (
        {"elf": out_dir / f"{group.name}.elf"} if fmt == "elf" else
        {"xclbin": out_dir / f"{group.name}.xclbin", "insts": out_dir / f"{group.name}.insts.bin"})
    missing = [str(p) for p in produced.values() if not Path(p).exists()]
    if missing:
        raise ToolchainError(f"aircc succeeded on {group.name} but did not write {', '.join(missing)}")
    if fmt == "elf":
        produced["kernel"] = f"main:{group.name}"
    return produced
