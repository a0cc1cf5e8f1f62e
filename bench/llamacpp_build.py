"""llama-cpp-python built from its PyPI sdist into a venv of its own under the cache.

The bench needs llama.cpp as a peer, not as a dependency: it lives in its own venv (the
project's environment never sees it) under the cache's `bench/` folder (`paths.bench_dir`),
built once and reused.

Why a source build with explicit ISA switches: a default build compiles ggml with
`-march=native`, which on these hosts also enables ggml's AMX path, and that path dies with
SIGILL. So `GGML_NATIVE` is off, the three `GGML_AMX_*` switches are off, and every other x86
switch is turned on exactly when /proc/cpuinfo lists the instructions it compiles for — the
build is as fast as a native one, minus AMX. The build folder is keyed by the version and these
switches, so a different CPU gets its own build. A failed build is remembered (with its log)
so that later runs report it at once instead of spending minutes failing again.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from bench import BenchError
from bench.machine import cpu_flags
from llama_base.paths import bench_dir

DIST = "llama-cpp-python"
VERSION = "0.3.36"
# The HF-to-GGUF converter in the sdist imports sentencepiece even for BPE vocabularies.
CONVERTER_DEPS = ("sentencepiece==0.2.3",)

# ggml's x86 instruction-set switches and the /proc/cpuinfo flags each one compiles for.
ISA_SWITCHES = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
AMX_SWITCHES = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


@dataclass(frozen=True)
class LlamaCpp:
    python: Path          # an interpreter that can import llama_cpp
    converter: Path       # convert_hf_to_gguf.py from the same sdist
    converter_path: Path  # PYTHONPATH entry holding the converter's extra dependencies
    version: str
    cmake_args: tuple[str, ...]


def cmake_args(flags: frozenset[str]) -> tuple[str, ...]:
    args = ["-DGGML_NATIVE=OFF", *(f"-D{s}=OFF" for s in AMX_SWITCHES)]
    args += [f"-D{s}={'ON' if all(f in flags for f in need) else 'OFF'}" for s, need in ISA_SWITCHES.items()]
    args.append("-DLLAVA_BUILD=OFF")   # the multimodal library: not needed, and minutes of compiling
    return tuple(args)


def _run(cmd: list[str], log_file: Path, env: dict[str, str] | None = None) -> None:
    with open(log_file, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        tail = log_file.read_text(errors="replace").splitlines()[-15:]
        raise BenchError(f"`{' '.join(cmd[:4])} ...` failed (exit {r.returncode}); log {log_file}:\n  "
                         + "\n  ".join(tail))


def _fetch_sdist(dest: Path, log_file: Path) -> Path:
    download = dest / "download"
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
          f"{DIST}=={VERSION}", "-d", str(download)], log_file)
    (archive,) = download.glob("*.tar.gz")
    with tarfile.open(archive) as tf:
        tf.extractall(dest, filter="data")
    (src,) = [p for p in dest.iterdir() if p.is_dir() and p.name != "download"]
    shutil.rmtree(download)
    return src


def _layout(root: Path) -> tuple[Path, Path, Path]:
    return root / "venv" / "bin" / "python", root / "converter-deps", root / "build.log"


def ensure_llamacpp(log: Callable[[str], None] = print, rebuild: bool = False,
                    cpu_class: str = "native") -> LlamaCpp:
    """The built llama-cpp-python (building it on first use) for `cpu_class`, or a BenchError saying why not."""
    args = cmake_args(cpu_flags(cpu_class))
    digest = hashlib.sha256("\n".join(args).encode()).hexdigest()[:12]
    root = bench_dir() / f"llama-cpp-python-{VERSION}-{digest}"
    python, deps, log_file = _layout(root)
    stamp, failed = root / "stamp.json", root / "failed.json"
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root.parent / f".{root.name}.lock")):
        if stamp.is_file() and python.exists():
            return LlamaCpp(python, Path(json.loads(stamp.read_text())["converter"]), deps, VERSION, args)
        if failed.is_file() and not rebuild:
            raise BenchError(f"the llama-cpp-python build failed before ({json.loads(failed.read_text())['error']}); "
                             f"log {log_file}; retry with --rebuild-llamacpp")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        log(f"[bench] building {DIST} {VERSION} from source into {root} (once; several minutes)")
        t0 = time.perf_counter()
        try:
            src = _fetch_sdist(root / "src", log_file)
            _run([sys.executable, "-m", "venv", str(root / "venv")], log_file)
            env = dict(os.environ, CMAKE_ARGS=" ".join(args), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
            _run([str(python), "-m", "pip", "install", "--no-binary", DIST, str(src)], log_file, env)
            _run([str(python), "-c", "import llama_cpp"], log_file)
            _run([sys.executable, "-m", "pip", "install", "--target", str(deps), *CONVERTER_DEPS], log_file)
        except BenchError as e:
            failed.write_text(json.dumps({"error": str(e).splitlines()[0]}) + "\n")
            raise
        converter = src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
        if not converter.is_file():
            raise BenchError(f"{DIST} {VERSION}'s sdist has no {converter.relative_to(src)}")
        stamp.write_text(json.dumps({"version": VERSION, "cmake_args": list(args), "converter": str(converter),
                                     "seconds": round(time.perf_counter() - t0, 1)}, indent=2) + "\n")
        log(f"[bench] {DIST} built in {time.perf_counter() - t0:.0f} s")
        return LlamaCpp(python, converter, deps, VERSION, args)
