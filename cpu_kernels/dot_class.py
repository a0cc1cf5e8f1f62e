"""Of two native classes that differ only in their pair dot products, the one this CPU runs.

The two (`RIVALS`, simd_bf16.h) are vdpbf16ps, or two FMAs on activations widened once. Which
is faster is the CPU's: on a Xeon (family 6, model 207) vdpbf16ps issued at a quarter of the
rate of vfmadd231ps and the FMA GEMM ran 1.2-1.65x faster; a core that issues vdpbf16ps as fast
as an FMA (Zen 5) runs it at about twice the FMAs' rate. So a CPU that has both runs whichever
GEMM it times faster, the FMAs only by a clear margin (`MARGIN`).

On bf16 weights the two give the same bits. On Q4NX weights they do not: `avx512` takes
decode's activations one byte wide and prefills on byte products (native_build), because the
cores it wins on are the ones whose vector ports held the two-byte kernels below memory's rate.
So the choice is remembered (`CHOICE_FILE`): every process on one machine makes the same one,
rather than re-deciding it on a timing that a busy moment can tip, and no start pays the
timing's 30 ms again.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import time
from pathlib import Path

import torch

from llama_base.paths import native_dir

RIVALS = ("avx512bf16", "avx512")
MARGIN = 1.15
CHOICE_FILE = "dot_class.txt"   # under the native cache: "<CPU and builds>\t<class>", the last choice made


def gemm_seconds(lib: ctypes.CDLL) -> float:
    """The fastest of 6 calls (the first wakes the team) of `lib`'s GEMM (bound by
    `native_cpu`) on a 128 x 512 x 2048 product (about 2 ms each)."""
    m, n, k = 128, 512, 2048
    w = torch.full((n, k), 0.01, dtype=torch.bfloat16)
    a = torch.full((m, k), 0.5, dtype=torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16)
    pairs = ctypes.c_int64()
    packed = torch.empty(lib.pack_weight_bf16_cpu_plan(w.data_ptr(), n, k, ctypes.byref(pairs)), dtype=torch.uint8)
    lib.pack_weight_bf16_cpu(w.data_ptr(), n, k, pairs.value, packed.data_ptr())
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        lib.gemm_packed_bf16_cpu(a.data_ptr(), packed.data_ptr(), c.data_ptr(), m, n, k)
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_identity() -> str | None:
    """A digest of the first CPU's maker, family, model, stepping, name and flags as
    /proc/cpuinfo gives them (a VM moved to another host model, or given other flags, differs);
    None where it cannot say."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return None
    fields = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")
    lines = [line for line in first.splitlines() if line.split(":", 1)[0].strip() in fields]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16] if lines else None


def choice_path() -> Path:
    return native_dir() / CHOICE_FILE


def faster(bf16: ctypes.CDLL, fma: ctypes.CDLL) -> ctypes.CDLL:
    """Of the two RIVALS libraries (bound), the one whose GEMM this CPU runs faster: as
    remembered for this CPU and these two builds, else timed now and remembered. A CPU that
    cannot say what it is (`cpu_identity`) is timed every time."""
    libs = dict(zip(RIVALS, (bf16, fma)))
    cpu = cpu_identity()
    key = f"{cpu} {Path(bf16._name).name} {Path(fma._name).name}" if cpu else None
    path = choice_path()
    if key:
        try:
            held_key, held = path.read_text().strip().rsplit("\t", 1)
        except (OSError, ValueError):
            held_key = held = ""
        if held_key == key and held in libs:
            return libs[held]
    chosen = RIVALS[1] if gemm_seconds(bf16) > MARGIN * gemm_seconds(fma) else RIVALS[0]
    if key:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(f"{key}\t{chosen}\n")
            os.replace(tmp, path)     # whole or not at all, for a process reading it meanwhile
        except OSError:
            tmp.unlink(missing_ok=True)
    return libs[chosen]
