"""What the bench ran on: CPU model and flags, cores, memory, and how busy the machine was.

Timings are only comparable on a quiet machine, so every runtime's run records how much CPU
*other* processes used meanwhile: all busy CPU time of the machine (from /proc/stat, steal
included, since a hypervisor's other guests slow us too) minus what the runtime's own child
used. The load average cannot tell that apart: it still carries the previous child's work for
minutes after it ended.
"""
from __future__ import annotations

import os
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")
STAT = Path("/proc/stat")
# /proc/stat's first line: user nice system idle iowait irq softirq steal (guest time is inside user).
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def _cpuinfo_field(name: str) -> str:
    """The first CPU's value for the key `name` itself ("model" is not "model name")."""
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return ""


# AMD's core generations by family and model ranges, as Linux assigns them (arch/x86/kernel/cpu/
# amd.c). A VM's model name is often only "AMD EPYC", and a figure's meaning depends on the core:
# Zen 4 runs 512-bit instructions in two halves, Zen 5's server parts in one.
_AMD_CORES: dict[int, tuple[tuple[int, int, str], ...]] = {
    0x17: ((0x00, 0x2F, "Zen/Zen+"), (0x50, 0x5F, "Zen/Zen+"), (0x30, 0x4F, "Zen 2"), (0x60, 0x7F, "Zen 2"),
           (0x90, 0x91, "Zen 2"), (0xA0, 0xAF, "Zen 2")),
    0x19: ((0x00, 0x0F, "Zen 3"), (0x20, 0x5F, "Zen 3"), (0x10, 0x1F, "Zen 4"), (0x60, 0xAF, "Zen 4")),
    0x1A: ((0x00, 0x2F, "Zen 5"), (0x40, 0x4F, "Zen 5"), (0x60, 0x7F, "Zen 5"), (0x50, 0x5F, "Zen 6"),
           (0x80, 0xAF, "Zen 6"), (0xC0, 0xCF, "Zen 6")),
}


def core_name(vendor: str, family: int | None, model: int | None) -> str:
    """The core generation where the family and model name one, else the numbers themselves."""
    if family is None or model is None:
        return "unknown core"
    ids = f"family {family}, model {model}"
    if vendor == "AuthenticAMD":
        for lo, hi, name in _AMD_CORES.get(family, ()):
            if lo <= model <= hi:
                return f"{name} ({ids})"
    return f"{vendor or 'unknown vendor'} {ids}"


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def this_core() -> str:
    return core_name(_cpuinfo_field("vendor_id"), _int_or_none(_cpuinfo_field("cpu family")),
                     _int_or_none(_cpuinfo_field("model")))


# A bench can run "as" a lower CPU class on a machine that has a higher one: each runtime is
# kept off the instructions the class lacks. `native` is the machine as it is.
# `avxvnni` is an Intel client core from Alder Lake on: AVX2 and AVX-VNNI, no AVX-512.
CPU_CLASSES: dict[str, tuple[str, ...]] = {
    "native": (), "avxvnni": ("avx512", "amx"), "avx2": ("avx512", "amx", "avx_vnni"),
}
CLASS_ENV: dict[str, dict[str, str]] = {
    "native": {},
    # ours: the native library's class; torch (ours and HF): ATen's kernels and oneDNN's
    "avxvnni": {"LLAMA_NPU_ISA": "avxvnni", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
    "avx2": {"LLAMA_NPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def cpu_flags(cpu_class: str = "native") -> frozenset[str]:
    """The CPU's feature flags, less those `cpu_class` does not have (llama.cpp is built for these)."""
    hidden = CPU_CLASSES[cpu_class]
    return frozenset(f for f in _cpuinfo_field("flags").split() if not f.startswith(hidden))


@dataclass(frozen=True)
class CpuSample:
    at_s: float
    machine_busy_s: float | None   # None where /proc/stat is unreadable
    children_s: float              # CPU time of this process's finished children


def cpu_sample() -> CpuSample:
    busy = None
    try:
        fields = STAT.read_text().splitlines()[0].split()[1:]
        busy = sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return CpuSample(time.perf_counter(), busy, ru.ru_utime + ru.ru_stime)


def other_cores(before: CpuSample, after: CpuSample) -> float | None:
    """Cores' worth of CPU that processes other than our children used between two samples."""
    if before.machine_busy_s is None or after.machine_busy_s is None or after.at_s <= before.at_s:
        return None
    others = (after.machine_busy_s - before.machine_busy_s) - (after.children_s - before.children_s)
    return max(others, 0.0) / (after.at_s - before.at_s)


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field (MemTotal, MemAvailable, ...) in bytes; None where it cannot be read."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe(cpu_class: str = "native") -> dict:
    mem = meminfo_bytes("MemTotal") or 0
    flags = cpu_flags()
    return {
        "cpu": _cpuinfo_field("model name") or platform.processor(),
        "core": this_core(),
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "isa": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "avx_vnni"))),
        "cpu_class": cpu_class,
        "class_env": CLASS_ENV[cpu_class],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
