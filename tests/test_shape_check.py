"""A model whose shapes the NPU's groups cannot tile is refused in one line naming the dimension
and the rule, before a weight is read; every model the runtime ships or names tiles."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llama_base.config import LLAMA_3_1_8B, LLAMA_3_2_1B, LLAMA_3_2_3B
from llama_runtime.cli import run
from llama_runtime.generation import session as session_module
from multi_launch_builder import shape_check
from multi_launch_builder.shape_check import check_tiles, tiling_problem


@pytest.mark.parametrize("cfg", [LLAMA_3_2_1B, LLAMA_3_2_3B, LLAMA_3_1_8B], ids=["1b", "3b", "8b"])
def test_the_family_tiles_in_both_formats(cfg):
    assert tiling_problem(cfg, "bf16") is None and tiling_problem(cfg, "q4nx") is None


@pytest.mark.parametrize("change,words", [
    ({"num_attention_heads": 5}, ["5 query heads over 2 KV heads", "whole number of query heads"]),
    ({"head_dim": 96}, ["head_dim 96", "bytes of L1", "budget"]),
    ({"head_dim": 80}, ["the k_gemm weight, 160 x", "32-bit word"]),
    ({"hidden_size": 200}, ["hidden 200", "no GEMV tiling of 200x"]),
])
def test_an_untileable_shape_is_one_line_naming_the_dimension_and_the_rule(tiny_config, change, words):
    problem = tiling_problem(replace(tiny_config, **change))
    assert problem and "\n" not in problem and all(w in problem for w in words), problem


def test_a_verdict_is_kept_for_the_same_shapes_and_code(tiny_config, tmp_path, monkeypatch):
    calls = []
    real = shape_check.tiling_problem
    monkeypatch.setattr(shape_check, "tiling_problem", lambda cfg, quant: calls.append(quant) or real(cfg, quant))
    bad = replace(tiny_config, head_dim=96)
    first = check_tiles(bad, "bf16", tmp_path)
    assert check_tiles(bad, "bf16", tmp_path) == first and calls == ["bf16"]
    assert check_tiles(tiny_config, "bf16", tmp_path) is None and calls == ["bf16", "bf16"]
    (entry,) = [p for p in tmp_path.iterdir() if json.loads(p.read_text())["problem"] == first]
    entry.write_text("{not json")                           # a damaged entry is asked again
    assert check_tiles(bad, "bf16", tmp_path) == first and len(calls) == 3


def test_the_command_line_refuses_an_untileable_model_before_loading(tiny_config, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("weights were loaded")
    monkeypatch.setattr(session_module, "load_weights", no_load)
    resolved = session_module.resolve_model("tiny", lambda s: None, "bf16")
    monkeypatch.setattr(session_module, "resolve_model",
                        lambda *a, **k: replace(resolved, config=replace(resolved.config, head_dim=96)))
    code = run.run_cli(["--model", "tiny", "--device", "sim", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "do not tile onto the NPU's groups: head_dim 96" in err[0]
