"""The runtime on a CPU with no AVX-512 at all, where an AVX-512 instruction faults: the native
kernel, tile and ISA tests (less the greedy generation across classes, below) rerun in a child
under QEMU's user-mode emulation of an Intel Haswell, whose CPUID reports AVX2, FMA and F16C and
nothing newer. What this shows is the instruction set and the class the probes pick; QEMU's speed
says nothing about a real CPU's (docs/profile.md has the measured figures and their machine).
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_kernels import native_build, native_cpu

ROOT = Path(__file__).resolve().parents[1]
QEMU = shutil.which("qemu-x86_64")
FILES = ["tests/test_native_matmul.py", "tests/test_native_host_ops.py", "tests/test_tiles.py", "tests/test_isa.py",
         "tests/test_q4nx.py", "tests/test_q4nx_int_gemm.py"]
pytestmark = [pytest.mark.qemu,
              pytest.mark.skipif(QEMU is None or platform.machine() != "x86_64",
                                 reason="qemu-user is not installed (apt-get install qemu-user)")]


def _child(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (native_cpu.ENV_ISA, "LLAMA_NPU_NATIVE")}
    return subprocess.run([QEMU, "-cpu", "Haswell", sys.executable, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)


def test_a_haswell_gets_the_avx2_class():
    r = _child("-c", "from cpu_kernels import native_cpu as n; print(n.supported_isas(), n.isa())")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[0] == "['avx2'] avx2"


def test_the_kernel_tests_pass_on_a_cpu_without_avx512():
    if native_cpu.supported_isas() == ["avx2"]:
        # The suite itself has just run these files on a real CPU without AVX-512, where an
        # emulated rerun only repeats them many times slower.
        pytest.skip("this CPU has no AVX-512: the suite ran these files natively on it")
    # Every class's library is built here, natively, and the emulated run loads them: a compiler
    # forked from a threaded process under qemu-user can hang on a lock the fork copied held.
    # For the same reason the tests of the build itself stay out (the suite runs them natively),
    # and so does the greedy generation across classes: emulated, its torch side is most of the
    # rerun's time, and the suite compares the same classes natively on this CPU.
    for isa in native_build.ALL_CLASSES:
        native_build.library_path(isa)
    skip = ("greedy_generation", "least_recently_used_builds", "compile_side_by_side", "links_whole")
    r = _child("-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", " and ".join(f"not {s}" for s in skip),
               *FILES)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and int(summary.split(" passed")[0].split()[-1]) > 100, summary
