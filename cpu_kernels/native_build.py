"""Building the native CPU kernels: which sources, which ISA classes with which compiler flags,
and the compile-once cache of shared libraries. `native_cpu` chooses and loads a class; the
bench builds its own probes with `build_shared`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llama_base import q4nx
from llama_base.paths import native_dir

_NATIVE = Path(__file__).resolve().parent / "native"
_SRCS = [_NATIVE / f"{name}_bf16_cpu.cc"
         for name in ("matmul", "pack", "eltwise", "attention", "flash_attention", "matmul_tiles",
                      "resident_kv")]
_SRCS += [_NATIVE / f"{name}_cpu.cc" for name in ("q4nx", "q4nx_gemm", "rows", "stream_ahead", "program", "team")]
_HEADERS = [_NATIVE / "simd_bf16.h", _NATIVE / "packed_tiles.h", _NATIVE / "tiles_bf16.h", _NATIVE / "q4nx_blocks.h",
            _NATIVE / "q4nx_activations.h", _NATIVE / "stream_split.h", _NATIVE / "replayed.h"]
# The Q4NX layout as the kernels see it: from its one declaration.
_Q4NX = [f"-DQ4NX_{name}={value}" for name, value in
         (("ROWS", q4nx.ROWS), ("COLS", q4nx.COLS), ("GROUP", q4nx.GROUP), ("FIXED_BITS", q4nx.FIXED_BITS),
          ("NARROW_LEVELS", q4nx.NARROW_LEVELS), ("NARROW_FLOOR_EXP", q4nx.NARROW_FLOOR_EXP))]
# Every symbol a library calls resolved when it is linked: a kernel one file declares and no
# source defines fails the build of every class on every machine, where it would otherwise build
# and then fail to load only on a CPU of that class.
LINK_CHECKS = ["-Wl,-z,defs"]
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", *LINK_CHECKS, *_Q4NX]
# ISA classes, best first: the compiler flags each library is built with. The AVX2 build gets
# no AVX-512 flag at all, so nothing in it can fault on a CPU without AVX-512.
# VNNI's word dot product (vpdpwssd) is in every CPU with AVX512-BF16 (Cooper Lake, Sapphire
# Rapids, Zen 4): the Q4NX GEMV's integer sums use it.
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
_AVX512BF16 = [*_AVX512, "-mavx512bf16"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
# `avx512` is AVX-512 without vdpbf16ps: its pair dot products are two FMAs on activations
# widened once (simd_bf16.h). It serves CPUs with AVX-512 but no BF16 (Ice Lake), and those
# whose vdpbf16ps is slower than its FMAs (Intel's): on a CPU that has both classes,
# native_cpu times their GEMMs and runs the faster.
# `avxvnni` is AVX2 with AVX-VNNI's vpdpbusd on 256-bit vectors (Intel's cores from Alder Lake
# on, which have no AVX-512): the AVX2 kernels, except that the Q4NX byte products sum in 32 bits
# with no saturation to avoid, which takes three of the seven vector operations per 32 bytes off
# the GEMV's inner loop (q4nx_cpu.cc).
ISAS = {
    "amx": [*_AVX512BF16, "-mamx-tile", "-mamx-bf16"],
    "avx512bf16": _AVX512BF16,
    "avx512": _AVX512,
    "avxvnni": [*_AVX2, "-mavxvnni"],
    "avx2": _AVX2,
}
# Classes that emulate an ISA this CPU may lack: never picked unasked, never in supported_isas().
EMULATIONS = {"amx-emulated": [*_AVX2, "-DNATIVE_TILES_EMULATED=1"]}
ALL_CLASSES = {**ISAS, **EMULATIONS}
# Classes whose GEMM runs on (real or emulated) AMX tiles, in TDPBF16PS's summation order.
TILE_CLASSES = frozenset({"amx", "amx-emulated"})
# Classes whose prefill multiplies Q4NX weights on decode's integer contract (q4nx_gemm_cpu.cc's
# gemm_q4nx_int_cpu: fixed-point activations, exact byte sums) instead of dequantizing them to
# bf16 for the float GEMM: where that measured faster (docs/profile.md, "4-bit weights"). AVX2's
# FMA GEMM does 16 multiply-adds a cycle where vpmaddubsw does 32 byte products. The `avx512`
# class runs where vdpbf16ps is slow, on Intel's cores, and there vpdpbusd on one-byte
# activations ran the GEMM at 2.6 times its FMAs' rate. On a Zen 5 vdpbf16ps already matches
# vpdpbusd on two-byte activations, and the tiles are far ahead of both.
INTEGER_Q4NX_GEMM = frozenset({"avx2", "avxvnni", "avx512"})
# Classes whose Q4NX decode (and integer prefill) takes activations one byte wide (q4nx.NARROW)
# rather than two (q4nx.WIDE): half the byte products. AVX2's vpmaddubsw forms the two-byte
# contract at about a third of AVX-512 VNNI's rate, too slow to keep up with memory. On Intel's
# cores (the `avx512` class, and `amx`, whose decode runs the same AVX-512 code) the two-byte
# GEMV read 86 % of the memory's rate and the one-byte one 95 %: there the vector ports, not
# memory, held it back (docs/profile.md, "4-bit weights"). A Zen 5's `avx512bf16` keeps the wide
# width, the closer to the NPU's bf16 products, where it kept pace.
Q4NX_NARROW_ACTIVATIONS = frozenset({"avx2", "avxvnni", "avx512", "amx"})
# The /proc/cpuinfo flag of each compiler flag above. A class whose flags the CPU lacks is not
# even built (on an AVX2-only CPU that saves compiling the AVX-512 library, about 15 s of a first
# run, only for its probe to refuse it); where the flags are listed, the probe decides.
_CPUINFO = {"-mavx512f": "avx512f", "-mavx512bw": "avx512bw", "-mavx512vl": "avx512vl", "-mavx512bf16": "avx512_bf16",
            "-mavx512vnni": "avx512_vnni", "-mamx-tile": "amx_tile", "-mamx-bf16": "amx_bf16", "-mavx2": "avx2",
            "-mfma": "fma", "-mf16c": "f16c", "-mavxvnni": "avx_vnni"}
CPU_FLAGS = {isa: {_CPUINFO[f] for f in flags if f.startswith("-m")} for isa, flags in ALL_CLASSES.items()}


def build_shared(srcs: Path | list[Path], flags: list[str], headers: list[Path] = ()) -> Path | None:
    """The sources compiled into one shared library under the cache, or None without a working compiler.

    Keyed by the sources, the headers they include and the flags, so an edit rebuilds it, and
    renamed into place so that a concurrent process never loads a half-written file. Each use
    marks the library as used (its time), and a new build removes the least recently used
    builds of the same sources beyond `KEEP_BUILDS`: every source version and class would
    otherwise stay (about 250 KB each).
    """
    srcs = [srcs] if isinstance(srcs, Path) else srcs
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return None
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in [*srcs, *headers]) + " ".join(flags).encode()).hexdigest()[:16]
    out = native_dir() / f"{srcs[0].stem}-{digest}.so"
    try:
        os.utime(out)
        return out
    except FileNotFoundError:
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    with tempfile.TemporaryDirectory(dir=out.parent) as objs:
        if not _compile([cxx, *flags], srcs, Path(objs), tmp):
            tmp.unlink(missing_ok=True)
            return None
    os.replace(tmp, out)
    _remove_unused_builds(out, srcs[0].stem)
    return out


def _compile(command: list[str], srcs: list[Path], objs: Path, lib: Path) -> bool:
    """Each source to an object, as many at once as there are cores, then one link: on a 2-core
    Zen 3 the native library takes 13 s where it took 19 s one source after another."""
    if len(srcs) == 1:
        return subprocess.run([*command, str(srcs[0]), "-o", str(lib)], capture_output=True).returncode == 0
    outs = [objs / f"{i}-{src.stem}.o" for i, src in enumerate(srcs)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = pool.map(lambda so: subprocess.run([*command, "-c", str(so[0]), "-o", str(so[1])], capture_output=True),
                        zip(srcs, outs))
        if any(r.returncode != 0 for r in list(done)):
            return False
    return subprocess.run([*command, *map(str, outs), "-o", str(lib)], capture_output=True).returncode == 0


# Builds of one set of sources kept: the classes a machine runs (up to six, tests force each
# lower one) for two versions of the sources, so switching between two checkouts rebuilds nothing.
KEEP_BUILDS = 12


def _remove_unused_builds(new: Path, stem: str) -> None:
    """Remove all but the `KEEP_BUILDS` most recently used builds of `stem`'s sources. A process
    that has one of them loaded keeps its mapping."""
    builds = sorted(new.parent.glob(f"{stem}-" + "[0-9a-f]" * 16 + ".so"), key=_used, reverse=True)
    for old in builds[KEEP_BUILDS:]:
        if old != new:
            old.unlink(missing_ok=True)


def _used(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def library_path(isa: str) -> Path | None:
    """The shared library built for ISA class `isa` (built now if needed), None without a compiler."""
    return build_shared(_SRCS, _FLAGS + ALL_CLASSES[isa] + [f"-DQ4NX_ACT_BYTES={activation_bytes(isa)}"], _HEADERS)


def activation_bytes(isa: str) -> int:
    """Decode's Q4NX activation width on class `isa` (`q4nx.fixed_point`)."""
    return q4nx.NARROW if isa in Q4NX_NARROW_ACTIVATIONS else q4nx.WIDE


def cpu_flags() -> set[str] | None:
    """The kernel's CPU flags, None where /proc/cpuinfo cannot say."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
