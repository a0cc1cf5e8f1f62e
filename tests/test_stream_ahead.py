"""How far ahead the decode GEMVs prefetch their weights (`stream_ahead_cpu.cc`): a knob for
comparing distances on a CPU, which must never change a result, and which the environment sets
or rejects in one line."""
from __future__ import annotations

import re

import pytest
import torch

from cpu_kernels import native_cpu
from llama_runtime.cli.profile_report import stream_ahead_line
from seeded import gemv_jobs, run_gemvs

pytestmark = [pytest.mark.skipif(native_cpu._library() is None, reason="no native library: the GEMVs are torch's")]


@pytest.mark.parametrize("fmt", ["q4nx", "bf16"])
def test_the_distance_never_changes_a_result(native_isa, fmt):
    # Jobs of one block and of many, so that a distance reaches past a job's end or stays inside it.
    shapes = [(32, 2048), (256, 2048), (64, 8192)]
    jobs, rows = gemv_jobs(fmt, shapes, seed=3), [n for n, _ in shapes]
    default, hint, outs = native_cpu.stream_ahead(), native_cpu.stream_hint(), []
    for ahead in (64, 2560, default, 4 * default, 1 << 20):
        for h in native_cpu.STREAM_HINTS:
            with native_cpu.pinned_stream_ahead(ahead), native_cpu.pinned_stream_hint(h):
                assert native_cpu.stream_ahead() == ahead and native_cpu.stream_hint() == h
                outs.append(run_gemvs(fmt, jobs, rows))
    assert native_cpu.stream_ahead() == default and native_cpu.stream_hint() == hint   # restored after the block
    assert not any(y.isnan().any() for y in outs[0])
    assert all(torch.equal(a, b) for ys in outs[1:] for a, b in zip(outs[0], ys))


def test_the_environment_sets_the_distance_or_says_what_it_takes(monkeypatch):
    isa = native_cpu.supported_isas()[0]
    monkeypatch.delenv(native_cpu.ENV_AHEAD, raising=False)
    with native_cpu.use_isa(isa):
        default = native_cpu.stream_ahead()
    assert default > 0
    monkeypatch.setenv(native_cpu.ENV_AHEAD, "8192")
    with native_cpu.use_isa(isa):
        assert native_cpu.stream_ahead() == 8192
        assert stream_ahead_line() == (f"decode GEMVs prefetch 8 KiB ahead (set by {native_cpu.ENV_AHEAD}), "
                                       f"hint {native_cpu.stream_hint().upper()}")
    monkeypatch.delenv(native_cpu.ENV_AHEAD)
    with native_cpu.use_isa(isa):
        assert native_cpu.stream_ahead() == default             # unset again: the library's own
        assert f"{default / 1024:g} KiB ahead (the default" in stream_ahead_line()
    for bad in ("-1", "5k", "0", "auto"):
        monkeypatch.setenv(native_cpu.ENV_AHEAD, bad)
        with pytest.raises(native_cpu.IsaError, match=f"{native_cpu.ENV_AHEAD}=.*positive number of bytes"):
            with native_cpu.use_isa(isa):
                pass


def test_every_class_starts_from_the_distance_of_this_cpu(monkeypatch):
    """5 KiB on a CPU with AVX-512 (measured on a Zen 5), 1 KiB on one without (measured on a
    Zen 3): the distance follows the core's bandwidth, so a class forced lower on an AVX-512
    CPU keeps the CPU's distance. Every class this machine runs or emulates is built here."""
    from cpu_kernels import native_build

    flags = native_build.cpu_flags()
    if flags is None:
        pytest.skip("/proc/cpuinfo cannot say whether this CPU has AVX-512")
    monkeypatch.delenv(native_cpu.ENV_AHEAD, raising=False)
    classes = native_cpu.supported_isas() + native_cpu.emulated_isas()
    expected = (5 if "avx512f" in flags else 1) * 1024
    for isa in classes:
        with native_cpu.use_isa(isa):
            assert native_cpu.stream_ahead() == expected, isa
    assert "avx2" in classes or "avx512bf16" in classes


def test_the_hint_follows_the_cpus_maker():
    """T1 on Intel (measured on a Xeon, where NTA prefetches held the Q4NX GEMV to two thirds of
    T1's rate and T0 to 89-96 %), NTA elsewhere (as fast or faster than T0 on the AMD VMs): for every
    class, since the hint is the core's, not the instructions'."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("/proc/cpuinfo cannot say who made this CPU")
    intel = "GenuineIntel" in text
    for isa in native_cpu.supported_isas() + native_cpu.emulated_isas():
        with native_cpu.use_isa(isa):
            assert native_cpu.stream_hint() == ("t1" if intel else "nta"), isa
    with pytest.raises(ValueError, match="expected one of nta, t1, t0"):
        with native_cpu.pinned_stream_hint("t2"):
            pass


def test_every_class_s_decode_gemvs_hold_a_prefetch_of_each_hint(class_disassembly):
    """A prefetch changes no result, so nothing else would notice a compiler dropping one: GCC 12
    removed every prefetch of a loop written per hint, and the GEMVs read about 30 % slower."""
    wanted = {f"prefetch{h}" for h in native_cpu.STREAM_HINTS}
    # Each GEMV's entry point and the row-block functions GCC may keep out of line.
    gemvs = {"q4nx": re.compile(r"gemv_q4nx_cpu_batch|gemv_row_block"),
             "bf16": re.compile(r"gemv_packed_bf16_cpu_batch|gemv_block")}
    for isa, text in class_disassembly.items():
        found, function = {fmt: set() for fmt in gemvs}, ""
        for line in text.splitlines():
            if (head := re.match(r"[0-9a-f]+ <(.*)>:$", line)) is not None:
                function = head.group(1)
            elif (op := re.search(r"\t(prefetch\w+)", line)) is not None:
                for fmt, name in gemvs.items():
                    if name.search(function):
                        found[fmt].add(op.group(1))
        assert all(wanted <= ops for ops in found.values()), (isa, found)
