"""`make compile` goes through the KernelCache: the second run compiles nothing."""
from __future__ import annotations

import json

from kernel_builder.fused_groups import resident_groups
from kernel_builder.groups import all_groups, prefill_buckets
from llama_runtime.cli import compile as compile_cli


def test_second_compile_builds_nothing(tiny_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_NPU_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config.to_dict()))
    args = ["--model-config", str(cfg), "--device", "sim", "--max-seq", "64", "--out", str(tmp_path / "mlir")]
    buckets = prefill_buckets(tiny_config, 64)
    # Both decodes' groups: the card's, and the fused decode's windows with each bucket's resident
    # attention, for a run's default context.
    resident = resident_groups(tiny_config, buckets, tiny_config.max_position_embeddings)
    assert {g.kind for g in resident} == {"flash_attn", "fused_decode"}
    groups = len(all_groups(tiny_config, buckets)) + len(resident)
    assert compile_cli.main(args) == 0
    first = capsys.readouterr().out
    assert f"sim: {groups} built, 0 already cached" in first
    assert len(list((tmp_path / "mlir").glob("*.mlir"))) == groups
    assert "kernel objects" in first          # built where Peano exists, else skipped with the reason
    assert compile_cli.main(args) == 0
    second = capsys.readouterr().out
    assert f"sim: 0 built, {groups} already cached" in second and "built (MLIR" not in second
    assert compile_cli.main(args + ["--decode", "layers"]) == 0
    assert f"sim: 0 built, {groups - len(resident)} already cached" in capsys.readouterr().out


def test_npu_target_without_toolchain_fails_cleanly(tiny_config, tmp_path):
    import pytest

    from kernel_builder.groups import build_group
    from multi_launch_builder.compile import ToolchainError, toolchain
    from npu_runtime.cache import KernelCache
    from npu_runtime.xrt.device import NpuTarget

    if toolchain().complete:
        pytest.skip("aircc and Peano are installed: the ELF path is exercised by make compile")
    kc = KernelCache(NpuTarget(), tmp_path)
    with pytest.raises(ToolchainError, match="missing"):
        kc.compile_and_cache(build_group("o_gemv_ffn", tiny_config))
    left = [p.relative_to(tmp_path) for p in tmp_path.rglob("*") if not p.name.endswith(".lock")]
    assert left == [kc.dir.relative_to(tmp_path)]       # the target's folder, and nothing in it
