"""Every stitched group module, the compile entry points and the `make compile` CLI."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
from pathlib import Path

import pytest
from mlir_samples import BUCKET, CONFIGS, resident_groups

from kernel_builder import externs, fused_groups, groups
from llama_runtime.engine.kv_cache import DEFAULT_MAX_CONTEXT
from llama_runtime.cli import compile as compile_cli
from multi_launch_builder import compile as kc
from multi_launch_builder.mlir_validate import validate_group_module


# A Q4_K_M file's layers: V and down projections kept in bf16 beside Q4NX weights.
WIDE = (frozenset(), frozenset({"wv", "w_down"}))


def all_groups(cfg):
    """Every group at one bucket, in every weight format, the quantized ones with the variants
    of a layer that keeps some weights in bf16; and the resident-KV groups."""
    return (groups.all_groups(cfg, (BUCKET,)) + groups.all_groups(cfg, (BUCKET,), "q4nx", WIDE)
            + resident_groups(cfg) + resident_groups(cfg, "q4nx"))


_TEXTS: dict = {}


def compiled(g):
    """`compile_group_mlir`, once per group in this module (a pure function of the declaration,
    `test_group_text_is_a_pure_function_of_the_declaration`): the fused decode of a 30-layer
    model is a module of some 500 launches."""
    if g not in _TEXTS:
        _TEXTS[g] = kc.compile_group_mlir(g)
    return _TEXTS[g]


def test_a_variant_changes_only_the_weights_it_keeps_in_bf16_and_their_launches():
    cfg = CONFIGS[sorted(CONFIGS)[0]]
    plain = groups.build_group("o_gemv_ffn", cfg, quant="q4nx")
    assert groups.build_group("o_gemv_ffn", cfg, quant="q4nx", wide={"wv"}) == plain    # not a weight it reads
    v = groups.build_group("o_gemv_ffn", cfg, quant="q4nx", wide={"wv", "w_down"})
    assert v.wide == ("w_down",) and v.name == "o_gemv_ffn_q4nx_bf16_w_down" and v.fingerprint() != plain.fingerprint()
    assert [(a.name, a.dtype, b.dtype) for a, b in zip(plain.slots, v.slots) if a != b] == [("w_down", "q4nx", "bf16")]
    changed = [(a.name, b.op) for a, b in zip(plain.launches, v.launches) if a != b]
    assert changed == [("down_proj", "gemv")]
    assert v.slot("w_down").nbytes == 2 * cfg.hidden_size * cfg.intermediate_size
    assert {g.name for g in all_groups(cfg)} >= {v.name, f"rms_gemms_rope_s{BUCKET}_q4nx_bf16_wv"}
    with pytest.raises(ValueError, match="only a quantized group"):
        groups.build_group("o_gemv_ffn", cfg, wide={"w_down"})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_group_module_validates_against_its_declaration(name):
    for g in all_groups(CONFIGS[name]):
        text = compiled(g)
        s = validate_group_module(text, g)           # parse, structure, cross-check
        assert [u.name for u in s.launches] == [f"{l.name}_launch" for l in g.launches]
        want = {k.symbol: k.link_object for l in g.launches for k in externs.externs_for_launch(l)}
        assert s.externs == want
        assert sorted(kc.link_objects(text)) == sorted(set(want.values()))


def _herd_links(text):
    """(link_with on the herd or None, callees inside it) for every herd, in text order."""
    out, stack = [], []
    for line in text.splitlines():
        if '"air.herd"(' in line:
            stack.append(set())
        elif "func.call @" in line and stack:
            stack[-1].add(re.search(r"func\.call @([\w.]+)", line).group(1))
        elif 'sym_name = "' in line and "_herd" in line and stack and line.lstrip().startswith("})"):
            link = re.search(r'link_with = "([^"]+)"', line)
            out.append((link.group(1) if link else None, stack.pop()))
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_external_object_is_linked_by_the_herd_that_calls_it(name):
    """A herd's link_with is what every aiecc links into its cores; an object named only by
    function declarations needs a recent aiecc. So each object a declaration names must be the
    one link_with of every herd calling that declaration's symbol."""
    herds_with_calls = 0
    for g in all_groups(CONFIGS[name]):
        text = compiled(g)
        declared = dict(re.findall(r'func\.func private @([\w.]+)\(.*link_with = "([^"]+)"', text))
        for link, callees in _herd_links(text):
            if not callees:
                continue
            herds_with_calls += 1
            assert link is not None, f"{g.name}: a herd calls {sorted(callees)} but names no object"
            assert {declared[c] for c in callees} == {link}, f"{g.name}: {sorted(callees)} not all in {link}"
        linked_by_herds = {link for link, callees in _herd_links(text) if callees}
        assert set(declared.values()) == linked_by_herds, f"{g.name}: objects linked from outside a herd"
    assert herds_with_calls > 0


def _launch_grids(text):
    """The iteration counts of every air.launch: its size operands are index constants."""
    consts = dict(re.findall(r"(%[\w.]+) = arith\.constant (\d+) : index", text))
    grids = []
    for ops in re.findall(r'"air\.launch"\(([^)]*)\)', text):
        sizes = [int(consts[o.strip()]) for o in ops.split(",") if o.strip() in consts]
        grids.append(math.prod(sizes))
    return grids


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_group_with_a_gridded_launch_omits_the_core_loop(name):
    """Without its while-true loop a core runs one launch iteration and stops, so a launch grid
    of more than one block would leave all but the first block uncomputed on hardware."""
    gridded = 0
    for g in [g for q in groups.QUANTS for g in groups.all_groups(CONFIGS[name], (BUCKET, 4 * BUCKET), quant=q)]:
        grids = _launch_grids(kc.compile_group_mlir(g))
        if max(grids) > 1:
            gridded += 1
            assert not dict(g.options).get("omit_while_true_loop"), f"{g.name}: launch grids {grids}"
    assert gridded > 0          # the prefill GEMMs have grids; the check is not vacuous


def test_group_text_is_a_pure_function_of_the_declaration():
    g = groups.o_ffn(CONFIGS["smollm2"], BUCKET)
    again = groups.o_ffn(CONFIGS["smollm2"], BUCKET)
    assert kc.compile_group_mlir(g) == kc.compile_group_mlir(again)


def test_attention_over_a_longer_context_is_its_own_module():
    g = groups.flash_attn(CONFIGS["llama32_1b"], BUCKET, 2 * BUCKET)
    text = kc.compile_group_mlir(g)
    assert f"func.func @{g.name}(" in text and "memref<8x256x64xbf16>" in text


def _no_toolchain(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("PEANO_INSTALL_DIR", raising=False)
    monkeypatch.setenv("LLAMA_NPU_CACHE", str(tmp_path / "cache"))


def test_toolchain_probe_and_compile_elf_without_a_toolchain(monkeypatch, tmp_path):
    _no_toolchain(monkeypatch, tmp_path)
    tc = kc.toolchain()
    assert (tc.aircc, tc.aiecc, tc.peano) == (None, None, None) and not tc.complete
    assert "aircc=none" in tc.stamp()
    g = groups.lm_head_gemv(CONFIGS["smollm2"])
    path = tmp_path / "m.mlir"
    path.write_text(kc.compile_group_mlir(g))
    with pytest.raises(kc.ToolchainError, match="missing aircc, aiecc"):
        kc.compile_elf(path, tmp_path, g)


def test_aircc_command_carries_the_group_options(tmp_path):
    tc = kc.Toolchain(Path("/opt/air/bin/aircc"), Path("/opt/aie/bin/aiecc"), Path("/opt/peano"))
    ffn = groups.o_ffn(CONFIGS["smollm2"], BUCKET)
    attn = groups.flash_attn(CONFIGS["smollm2"], BUCKET)
    cmd = kc.aircc_command(tc, tmp_path / "x.mlir", tmp_path, ffn)
    assert cmd[:2] == ["/opt/air/bin/aircc", str(tmp_path / "x.mlir")]
    assert {"--device=npu2", "--output-format=elf", "--peano=/opt/peano",
            f"--elf-name={tmp_path / (ffn.name + '.elf')}"} <= set(cmd)
    assert "--omit-while-true-loop" not in cmd
    assert "--omit-while-true-loop" not in kc.aircc_command(tc, tmp_path / "a.mlir", tmp_path, attn)
    single = dataclasses.replace(attn, options=tuple(sorted({**dict(attn.options), "omit_while_true_loop": True}.items())))
    assert "--omit-while-true-loop" in kc.aircc_command(tc, tmp_path / "a.mlir", tmp_path, single)


FAKE_AIRCC = """#!/bin/sh
# Stands in for aircc: records its arguments and writes the ELF it is asked for.
echo "$@" > "$(pwd)/aircc.args"
for a in "$@"; do case "$a" in --elf-name=*) : > "${a#--elf-name=}";; esac; done
"""


def test_compile_elf_links_objects_and_returns_the_artifacts(monkeypatch, tmp_path):
    _no_toolchain(monkeypatch, tmp_path)
    bin_dir, peano, objs = tmp_path / "bin", tmp_path / "peano", tmp_path / "objs"
    for d in (bin_dir, peano / "bin", objs):
        d.mkdir(parents=True)
    for tool, body in (("aircc", FAKE_AIRCC), ("aiecc", "#!/bin/sh\n")):
        (bin_dir / tool).write_text(body)
        (bin_dir / tool).chmod(stat.S_IRWXU)
    (peano / "bin" / "clang").write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("PEANO_INSTALL_DIR", str(peano))
    g = groups.rms_gemv_rope(CONFIGS["smollm2"])
    text = kc.compile_group_mlir(g)
    for obj in kc.link_objects(text):
        (objs / obj).write_bytes(b"\x7fELF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "g.mlir").write_text(text)
    files = kc.compile_elf(out / "g.mlir", out, g, objects_dir=objs)
    assert files == {"elf": out / f"{g.name}.elf", "kernel": f"main:{g.name}"}
    assert all((out / o).resolve() == (objs / o).resolve() for o in kc.link_objects(text))
    assert "--device=npu2" in (out / "aircc.args").read_text()


def test_cli_writes_every_group_module_and_says_what_it_skipped(monkeypatch, tmp_path, capsys):
    _no_toolchain(monkeypatch, tmp_path)
    monkeypatch.setenv("LLAMA_NPU_CACHE", str(tmp_path / "cache"))
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(CONFIGS["smollm2"].to_dict()))
    out = tmp_path / "mlir"
    args = ["--model-config", str(cfg_path), "--max-seq", str(BUCKET), "--out", str(out), "--device", "sim"]
    assert compile_cli.main(args) == 0
    smol = CONFIGS["smollm2"]
    buckets = groups.prefill_buckets(smol, BUCKET)
    want = {g.name for g in groups.all_groups(smol, buckets) + fused_groups.resident_groups(smol, buckets, DEFAULT_MAX_CONTEXT)}
    assert {p.stem for p in out.glob("*.mlir")} == want
    printed = capsys.readouterr().out
    assert "ELFs skipped: missing aircc, aiecc, Peano" in printed
    for name in want:
        assert f"[compile] {name}: " in printed
    assert "kernel objects skipped" in printed and "PEANO_INSTALL_DIR" in printed
