"""`make compile` goes through the KernelCache: the second run compiles nothing."""
from __future__ import annotations

import json

from kernel_builder import compile as compile_cli


def test_second_compile_builds_nothing(tiny_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_NPU_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config.to_dict()))
    args = ["--model-config", str(cfg), "--device", "sim", "--max-seq", "128", "--out", str(tmp_path / "mlir")]
    assert compile_cli.main(args) == 0
    first = capsys.readouterr().out
    assert "sim: 6 built, 0 already cached" in first
    assert len(list((tmp_path / "mlir").glob("*.mlir"))) == 6
    assert "kernel objects" in first          # built where Peano exists, else skipped with the reason
    assert compile_cli.main(args) == 0
    second = capsys.readouterr().out
    assert "sim: 0 built, 6 already cached" in second and "built (MLIR" not in second
