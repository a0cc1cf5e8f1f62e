"""The native library's ISA classes: which one runs, how it is chosen and reported, that the AVX2
builds hold no AVX-512 instruction, and that every class computes the same bits, the tile GEMM's
other summation order apart (the per-kernel checks against torch and float64 run under each
class through the `native_isa` fixture; tests/test_tiles.py holds the tiles to the SDM).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cpu_kernels import dot_class, native_build, native_cpu
from verify import reference as ref
from llama_runtime.checkpoints.loader import load_weights
from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.device_model import DeviceModel
from llama_runtime.checkpoints.resolve import resolve_model
from llama_runtime.engine.prefill import prefill
from llama_runtime.cli.profile_report import isa_line
from llama_runtime.text.tokenizer import Tokenizer
from npu_runtime.cache import KernelCache
from npu_runtime.devices import open_device
from npu_runtime.sim.device import SimDevice
from seeded import rand_bf16

NATIVE = native_cpu.supported_isas()
EMULATED = native_cpu.emulated_isas()


def _fresh(monkeypatch):
    """Forget the library chosen so far (monkeypatch restores it), so the next call chooses again."""
    monkeypatch.setattr(native_cpu, "_lib", None)
    monkeypatch.setattr(native_cpu, "_tried", False)
    monkeypatch.setattr(native_cpu, "_forced", None)
    monkeypatch.delenv(native_cpu.ENV_ISA, raising=False)
    monkeypatch.delenv("LLAMA_NPU_NATIVE", raising=False)
    monkeypatch.setattr(dot_class, "cpu_identity", lambda: None)   # the dot classes timed, not remembered


def test_the_device_says_which_kernels_run(native_isa, capsys):
    assert native_cpu.isa() == native_isa
    assert native_isa in SimDevice().name
    open_device("sim")
    assert f"CPU kernels: {native_isa}" in capsys.readouterr().out
    assert native_isa in isa_line()


def test_the_environment_picks_the_class(monkeypatch):
    _fresh(monkeypatch)
    monkeypatch.setattr(dot_class, "gemm_seconds", lambda lib: 1.0)   # dot classes alike: the first kept
    best = native_cpu.isa()
    assert best == (NATIVE[0] if NATIVE else native_cpu.TORCH)      # unforced: the best this CPU runs
    for asked in [*NATIVE, *EMULATED, native_cpu.TORCH]:
        _fresh(monkeypatch)
        monkeypatch.setenv(native_cpu.ENV_ISA, asked)
        assert native_cpu.isa() == asked and native_cpu.available() == (asked != native_cpu.TORCH)
    _fresh(monkeypatch)
    monkeypatch.setenv("LLAMA_NPU_NATIVE", "0")                      # the older switch: torch
    assert native_cpu.isa() == native_cpu.TORCH and native_cpu.tile_rows() == 0


@pytest.mark.skipif(not set(dot_class.RIVALS) <= set(NATIVE), reason="this CPU lacks AVX512-BF16 or AVX-512")
@pytest.mark.parametrize("bf16_s,fma_s,want",
                         [(1.0, 0.5, "avx512"), (1.0, 0.9, "avx512bf16"), (0.5, 1.0, "avx512bf16")])
def test_of_the_two_dot_classes_the_one_whose_gemm_is_faster_runs(monkeypatch, bf16_s, fma_s, want):
    """Unforced, a CPU with both runs the FMA class only where its GEMM is faster by dot_class.MARGIN."""
    _fresh(monkeypatch)
    seconds = {"avx512bf16": bf16_s, "avx512": fma_s}
    monkeypatch.setattr(dot_class, "gemm_seconds", lambda lib: seconds[lib.native_cpu_isa().decode()])
    assert native_cpu.isa() == want


class _DotLib:
    """A stand-in for a rival's library: its file name and its class."""

    def __init__(self, isa: str, name: str):
        self.isa, self._name = isa, f"/cache/native/{name}"

    def native_cpu_isa(self) -> bytes:
        return self.isa.encode()


def test_the_dot_choice_is_remembered_for_the_cpu_and_the_builds(monkeypatch, tmp_path):
    """Timed once, then every process on the machine makes the same choice, whatever a later
    timing would say; other builds, another CPU or a damaged record are timed again."""
    choice = tmp_path / dot_class.CHOICE_FILE
    monkeypatch.setattr(dot_class, "choice_path", lambda: choice)
    monkeypatch.setattr(dot_class, "cpu_identity", lambda: "cpu-a")
    seconds = {"avx512bf16": 1.0, "avx512": 0.5}
    timed = []
    monkeypatch.setattr(dot_class, "gemm_seconds", lambda lib: timed.append(lib.isa) or seconds[lib.isa])
    bf16, fma = _DotLib("avx512bf16", "matmul_bf16_cpu-1.so"), _DotLib("avx512", "matmul_bf16_cpu-2.so")

    assert dot_class.faster(bf16, fma) is fma and len(timed) == 2
    seconds["avx512"] = 2.0                                   # a timing now would keep avx512bf16
    assert dot_class.faster(bf16, fma) is fma and len(timed) == 2
    assert choice.read_text().endswith("\tavx512\n")

    rebuilt = _DotLib("avx512", "matmul_bf16_cpu-3.so")
    assert dot_class.faster(bf16, rebuilt) is bf16 and len(timed) == 4
    monkeypatch.setattr(dot_class, "cpu_identity", lambda: "cpu-b")
    seconds["avx512"] = 0.5
    assert dot_class.faster(bf16, rebuilt) is rebuilt and len(timed) == 6
    choice.write_text("cpu-b matmul_bf16_cpu-1.so matmul_bf16_cpu-3.so\tavx2\n")   # not a rival's name
    assert dot_class.faster(bf16, rebuilt) is rebuilt and len(timed) == 8
    choice.write_bytes(b"\xff\x00")
    assert dot_class.faster(bf16, rebuilt) is rebuilt and len(timed) == 10
    assert choice.read_text().endswith("\tavx512\n") and not list(tmp_path.glob("*.tmp"))

    monkeypatch.setattr(dot_class, "cpu_identity", lambda: None)   # no identity: timed every time
    assert dot_class.faster(bf16, rebuilt) is rebuilt and len(timed) == 12
    assert dot_class.faster(bf16, rebuilt) is rebuilt and len(timed) == 14


@pytest.mark.skipif(not NATIVE or "amx-emulated" not in EMULATED, reason="needs a native class and the emulation")
def test_the_unforced_choice_times_real_libraries_once_and_then_obeys_the_record(monkeypatch, tmp_path):
    """The whole path a process start takes, on real libraries, on any CPU: the best class this
    CPU runs stands in for `avx512bf16` and the AMX emulation for `avx512`. The first start
    times both GEMMs and keeps the one its own timings favour (on a real CPU the emulation is
    about 4x slower, but under an emulator such as QEMU's either may win); later starts read
    the record and time nothing, even where the record names the other class."""
    best = NATIVE[0]
    monkeypatch.setattr(dot_class, "RIVALS", (best, "amx-emulated"))
    choice = tmp_path / dot_class.CHOICE_FILE
    monkeypatch.setattr(dot_class, "choice_path", lambda: choice)
    timed = {}
    real_seconds = dot_class.gemm_seconds
    monkeypatch.setattr(dot_class, "gemm_seconds",
                        lambda lib: timed.setdefault(lib.isa, []).append(real_seconds(lib)) or timed[lib.isa][-1])

    _fresh(monkeypatch)
    monkeypatch.setattr(dot_class, "cpu_identity", lambda: "this-cpu")
    first = native_cpu.isa()
    assert sorted(timed) == sorted([best, "amx-emulated"]) and all(len(t) == 1 for t in timed.values())
    won = "amx-emulated" if timed[best][0] > dot_class.MARGIN * timed["amx-emulated"][0] else best
    other = "amx-emulated" if won == best else best
    key, held = choice.read_text().strip().rsplit("\t", 1)
    names = [Path(native_cpu._open(isa)._name).name for isa in (best, "amx-emulated")]
    assert first == held == won and key == f"this-cpu {names[0]} {names[1]}"

    _fresh(monkeypatch)
    monkeypatch.setattr(dot_class, "cpu_identity", lambda: "this-cpu")
    assert native_cpu.isa() == won and sum(map(len, timed.values())) == 2
    choice.write_text(f"{key}\t{other}\n")              # as if this CPU had timed the other way
    _fresh(monkeypatch)
    monkeypatch.setattr(dot_class, "cpu_identity", lambda: "this-cpu")
    assert native_cpu.isa() == other and sum(map(len, timed.values())) == 2


def test_the_cpu_identity_follows_proc_cpuinfo():
    """Stable within a machine, and a digest of the first CPU's fields (what a remembered dot
    choice is keyed by)."""
    ident = dot_class.cpu_identity()
    try:
        open("/proc/cpuinfo").close()
    except OSError:
        assert ident is None
        return
    assert ident is not None and re.fullmatch(r"[0-9a-f]{16}", ident) and ident == dot_class.cpu_identity()


def test_the_dot_classes_are_timed_on_their_own_gemms():
    """The probe runs each library's own GEMM: both time a real call, and neither is free."""
    if not set(dot_class.RIVALS) <= set(NATIVE):
        pytest.skip("this CPU lacks AVX512-BF16 or AVX-512")
    for isa in dot_class.RIVALS:
        assert 0 < dot_class.gemm_seconds(native_cpu._bind(native_cpu._open(isa))) < 1


def test_asking_for_more_than_the_cpu_has_is_a_one_line_error(monkeypatch):
    _fresh(monkeypatch)
    real = native_cpu._open
    monkeypatch.setattr(native_cpu, "_open", lambda isa: None if isa == "avx512bf16" else real(isa))
    monkeypatch.setenv(native_cpu.ENV_ISA, "avx512bf16")
    with pytest.raises(native_cpu.IsaError) as e:
        native_cpu.isa()
    assert "\n" not in str(e.value) and "avx512bf16" in str(e.value) and "torch" in str(e.value)
    _fresh(monkeypatch)
    monkeypatch.setenv(native_cpu.ENV_ISA, "avx9")
    with pytest.raises(native_cpu.IsaError, match="amx, avx512bf16, avx512, avxvnni, avx2, amx-emulated, torch"):
        native_cpu.isa()


def test_the_avx2_libraries_hold_no_avx512_instruction(class_disassembly):
    """What lets them load and run on a CPU without AVX-512: no zmm or mask register, and no EVEX
    encoding (which the upper 16 xmm/ymm registers would need). The AMX library holds the tile
    instructions, the emulation none; of the AVX2 ones only `avxvnni` holds AVX-VNNI's byte dot
    product, VEX-encoded."""
    evex = re.compile(r"%zmm\d|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b")
    text = class_disassembly
    for isa in ["avxvnni", "avx2", "amx-emulated"]:
        assert "vfmadd" in text[isa] and not evex.search(text[isa]) and "tdpbf16ps" not in text[isa], isa
        vex_dots = text[isa].count("{vex} vpdpbusd")
        assert (vex_dots > 0) == (isa == "avxvnni") and text[isa].count("vpdpbusd") == vex_dots, isa
    assert evex.search(text["avx512bf16"]) and "vdpbf16ps" in text["avx512bf16"]   # the check can see them
    assert evex.search(text["avx512"]) and "vdpbf16ps" not in text["avx512"]         # runs without AVX512-BF16
    assert "tdpbf16ps" in text["amx"] and "ldtilecfg" in text["amx"] and "tdpbf16ps" not in text["avx512bf16"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_a_new_build_removes_the_least_recently_used_builds_beyond_the_kept_number(tmp_path, monkeypatch):
    """Each source version and class is a build of its own; a new one removes the builds used
    least recently beyond `KEEP_BUILDS`, and loading a build counts as using it."""

    from llama_base.paths import ENV_CACHE, native_dir

    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    src = tmp_path / "probe_lib.cc"
    src.write_text('extern "C" int probe_lib() { return 1; }\n')
    native_dir().mkdir(parents=True)
    old = [native_dir() / f"probe_lib-{i:016x}.so" for i in range(native_build.KEEP_BUILDS + 2)]
    for i, path in enumerate(old):
        path.write_bytes(b"")
        os.utime(path, ns=(10**18 + i, 10**18 + i))      # old[0] least recently used
    other = native_dir() / f"other-{0:016x}.so"            # another library's builds are not counted
    other.write_bytes(b"")
    os.utime(other, ns=(10**18, 10**18))
    flags = ["-shared", "-fPIC"]
    os.utime(old[0])                                       # old[0]: loaded just now
    new = native_build.build_shared(src, flags)
    left = sorted(p.name for p in native_dir().glob("probe_lib-*.so"))
    assert len(left) == native_build.KEEP_BUILDS and new.name in left and old[0].name in left
    assert not any(p.exists() for p in old[1:4]) and all(p.exists() for p in old[4:]) and other.exists()
    os.utime(new, ns=(10**18, 10**18))
    assert native_build.build_shared(src, flags) == new and new.stat().st_mtime_ns > 10**18 + 10**9


def test_a_class_whose_flags_the_cpu_lacks_is_not_even_built(monkeypatch):
    """On an AVX2-only CPU the AVX-512 library would be compiled only for its probe to refuse
    it: /proc/cpuinfo's flags rule it out first. Where cpuinfo cannot say, or the class is
    asked for by name, the probe decides."""
    built = []
    monkeypatch.setattr(native_cpu, "library_path", lambda isa: built.append(isa))
    monkeypatch.setattr(native_cpu, "_probed", {})
    monkeypatch.setattr(native_cpu, "cpu_flags", lambda: {"avx2", "fma", "f16c", "sse4_2"})
    assert native_cpu._open("avx512bf16") is None and native_cpu._open("amx") is None and built == []
    assert native_cpu._open("avx2") is None and built == ["avx2"]          # built, then loaded (here: nothing)
    monkeypatch.setattr(native_cpu, "_probed", {})
    monkeypatch.setattr(native_cpu, "cpu_flags", lambda: None)
    native_cpu._open("avx512bf16")
    assert built == ["avx2", "avx512bf16"]
    # a kernel too old to list a flag: the class asked for by name is built, its probe decides
    monkeypatch.setattr(native_cpu, "_probed", {})
    monkeypatch.setattr(native_cpu, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv(native_cpu.ENV_ISA, "AVX512BF16")
    assert native_cpu._open("avx512bf16") is None and native_cpu._open("amx") is None
    assert built == ["avx2", "avx512bf16", "avx512bf16"]
    assert native_build.CPU_FLAGS["avx512bf16"] >= {"avx512f", "avx512_bf16"} and "amx_tile" in native_build.CPU_FLAGS["amx"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_sources_compile_side_by_side_into_one_library_and_a_broken_one_builds_nothing(tmp_path, monkeypatch):
    import ctypes

    from llama_base.paths import ENV_CACHE, native_dir

    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    a, b, bad = tmp_path / "two_a.cc", tmp_path / "two_b.cc", tmp_path / "two_bad.cc"
    a.write_text('extern "C" int two_b();\nextern "C" int two_a() { return 40 + two_b(); }\n')
    b.write_text('extern "C" int two_b() { return 2; }\n')
    bad.write_text("this is not C++\n")
    flags = ["-O2", "-shared", "-fPIC"]
    lib = native_build.build_shared([a, b], flags)
    assert ctypes.CDLL(str(lib)).two_a() == 42
    assert native_build.build_shared([a, bad], flags) is None
    assert native_build.build_shared([a], [*flags, *native_build.LINK_CHECKS]) is None    # two_b defined nowhere
    assert sorted(p.name for p in native_dir().iterdir()) == [lib.name]      # no objects, no half-written file
    assert native_build.build_shared([a], flags) is not None                 # unchecked, it would have built


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
def test_every_class_links_whole_where_the_compiler_takes_its_flags(tmp_path):
    """Each class's library is built whole (LINK_CHECKS), so a kernel declared in one source and
    missing from the class's build fails here, on any CPU, not at load on a CPU of that class.
    A class is left out only where the compiler refuses its instruction flags (AMX on an old one)."""
    empty = tmp_path / "empty.cc"
    empty.write_text("int empty_unit;\n")
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    built = []
    for isa, flags in native_build.ALL_CLASSES.items():
        if subprocess.run([cxx, *flags, "-c", str(empty), "-o", str(tmp_path / "empty.o")],
                          capture_output=True).returncode == 0:
            assert native_build.library_path(isa) is not None, f"the {isa} library does not link"
            built.append(isa)
    assert "avx2" in built


def _k2048() -> tuple[torch.Tensor, torch.Tensor]:
    """W and A of the GEMM with K = 2048, which the tiled classes sum in their own order."""
    return rand_bf16(96, 2048, seed=11, scale=0.02), rand_bf16(45, 2048, seed=12)


def _every_kernel() -> dict[str, torch.Tensor]:
    """Each native kernel's output on fixed operands (shapes with vector tails and leftover rows)."""
    w, x, a = rand_bf16(96, 584, seed=1, scale=0.02), rand_bf16(584, seed=2), rand_bf16(13, 584, seed=3)
    w.view(-1)[::97] = 1e-30                                   # units kept whole
    out = {"packed": native_cpu.pack_weight(w, lambda n: torch.zeros(n, dtype=torch.uint8))}
    out["gemv"] = torch.empty(96, dtype=torch.bfloat16)
    native_cpu.gemv_batch_call([(out["packed"], x, out["gemv"])])()
    out["gemm"] = torch.empty(13, 96, dtype=torch.bfloat16)       # K = 584: vector GEMM on every class
    native_cpu.gemm_call(a, out["packed"], out["gemm"])()
    w2, a2 = _k2048()
    out["gemm_k2048"] = torch.empty(45, 96, dtype=torch.bfloat16)  # tiles where the class has them
    out["packed_k2048"] = native_cpu.pack_weight(w2, lambda n: torch.zeros(n, dtype=torch.uint8))   # held, as below
    native_cpu.gemm_call(a2, out["packed_k2048"], out["gemm_k2048"])()
    g, u = rand_bf16(1000, seed=4, scale=4), rand_bf16(1000, seed=5)
    for name, call in [("swiglu", native_cpu.swiglu_call), ("add", native_cpu.add_call)]:
        out[name] = torch.empty_like(g)
        call(g, u, out[name])()
    out["rmsnorm"] = torch.empty_like(a)
    native_cpu.rmsnorm_call(a, x, out["rmsnorm"], 584, 1e-5)()
    rows, lut = rand_bf16(3, 80, seed=6), rand_bf16(3, 20, seed=7)      # held: a bound call keeps only pointers
    out["rope"] = torch.empty_like(rows)
    native_cpu.rope_call(rows, lut, out["rope"], 3, 4, 20)()
    q, k, v = rand_bf16(37, 4, 64, seed=8, scale=2), rand_bf16(2, 80, 64, seed=9, scale=2), rand_bf16(2, 80, 64, seed=10)
    out["flash"] = torch.empty_like(q)
    assert native_cpu.flash_attention(q, k, v, 20, out["flash"])
    out["decode_attention"] = torch.empty(4 * 64, dtype=torch.bfloat16)
    assert native_cpu.decode_attention(q[0].reshape(-1), k, v, 57, out["decode_attention"])
    # The resident cache's split attention in both its forms (head dims 64 and 80), and its merge.
    for d in (64, 80):
        kc, vc = rand_bf16(2, 200, d, seed=13, scale=2), rand_bf16(2, 200, d, seed=14)
        qd, pos = rand_bf16(6 * d, seed=15, scale=2), torch.tensor([170], dtype=torch.int32)
        out[f"decode_attn_{d}"], stats = torch.empty(2, 3, 3, d), torch.empty(2, 3, 3, 2)
        native_cpu.decode_attn_call(qd, kc, vc, pos, out[f"decode_attn_{d}"], stats, 64, 3)()
        out[f"attn_stats_{d}"], out[f"attn_merge_{d}"] = stats, torch.empty(6 * d, dtype=torch.bfloat16)
        native_cpu.attn_merge_call(out[f"decode_attn_{d}"], stats, out[f"attn_merge_{d}"], 2, 3, d)()
    return out


@pytest.mark.skipif(len(NATIVE + EMULATED) < 2, reason="this CPU runs one native ISA class")
def test_every_class_computes_the_same_bits():
    """The same operations in the same order: the pair dot step adds the odd product, then the
    even one, each rounded, which is how vdpbf16ps is specified (without subnormals, which it
    flushes); e^x, the reductions and the rounding to bf16 are spelled out alike. The tile GEMM
    sums in TDPBF16PS's order instead: the same bits among the tiled classes, and like the rest
    within the reference's bound for reordered sums."""
    results = {}
    for isa in NATIVE + EMULATED:
        with native_cpu.use_isa(isa):
            results[isa] = _every_kernel()
    first, *others = NATIVE + EMULATED
    for isa in others:
        for name, t in results[first].items():
            same = torch.equal(t.view(torch.uint8), results[isa][name].view(torch.uint8))
            if name == "gemm_k2048" and native_cpu.tiled(isa) != native_cpu.tiled(first):
                w, a = _k2048()
                for got in (t, results[isa][name]):
                    ref.assert_within_ulps(got, ref.lin(a, w), 1, ref.REORDERED, floor=ref.sum_floor(a, w), what=isa)
            else:
                assert same, f"{name}: {first} vs {isa}"


@pytest.fixture(scope="module")
def embedded():
    """SmolLM2 (the embedded model): trained weights, so greedy tokens are a real sequence."""
    folder = resolve_model("embedded").folder
    weights = load_weights(folder)
    return weights, Tokenizer(folder, weights.config)


def _greedy(weights, prompt: list[int], tmp_path, steps: int) -> tuple[list[int], list[torch.Tensor], bool]:
    model = DeviceModel(KernelCache(SimDevice(), tmp_path), weights, 64, buckets=(32,))
    packed = any(bo.packing for bo in model.kc._statics.values())
    logits = [prefill(model, prompt)]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps - 1):
        logits.append(decode_step(model, tokens[-1], len(prompt) + i))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits, packed


def test_greedy_generation_agrees_across_classes(embedded, tmp_path):
    """A prefill and decode steps on the embedded model under every class, torch included: the
    same tokens and, on the vector classes, the same logits to the bit; where torch's or the
    tiles' other summation order changes a token, a near-tie there (and prefill's logits show
    that the tiles ran). The native classes hold the weights packed, as the memory budget needs."""
    weights, tok = embedded
    prompt = tok.encode_text("The capital of Japan is")
    runs = {}
    vector = [isa for isa in NATIVE if not native_cpu.tiled(isa)]
    for isa in [*NATIVE, *EMULATED, native_cpu.TORCH]:
        with native_cpu.use_isa(isa):
            runs[isa] = _greedy(weights, prompt, tmp_path, steps=4)   # one kernel cache: ISA-independent
        assert runs[isa][2] == (isa != native_cpu.TORCH)
    ref_tokens, ref_logits, _ = runs[vector[0] if vector else native_cpu.TORCH]
    assert len(set(ref_tokens)) > 2, ref_tokens          # a real sequence, not one token repeated
    for isa, (tokens, logits, _) in runs.items():
        if isa in vector:
            assert tokens == ref_tokens and all(torch.equal(a, b) for a, b in zip(logits, ref_logits)), isa
            continue
        if native_cpu.tiled(isa):
            assert not torch.equal(logits[0], ref_logits[0]), isa
        for step, (mine, ref, l) in enumerate(zip(tokens, ref_tokens, ref_logits)):
            assert torch.allclose(logits[step], l, atol=5e-2 * l.abs().max().item()), (isa, step)
            if mine != ref:       # a near-tie: the two candidates' logits within the kernels' rounding
                assert (l[ref] - l[mine]).abs() < 1e-2 * l.abs().max(), (isa, step, tokens, ref_tokens)
                break
