"""The verification commands: the gate's rules, `make verify` on the embedded model, and that
deliberately broken numerics are caught by the gate and located by the diagnosis.

Our side runs in the test process (only the HF reference is a child process), so a bug is
injected by patching the runtime here; the reference is never affected by it.
"""
from __future__ import annotations

import json

import pytest
import torch

from llama_base.config import LlamaConfig
from llama_runtime.checkpoints.resolve import EMBEDDED, LLAMA1B_SHAPE, TINY_HD128
from npu_runtime.cache import KernelCache
from npu_runtime.sim import ops as sim_ops
from verify import __main__ as verify_cli
from verify.compare import TOP_K, gate_prompt, rank_of
from verify.diagnosis import COSINE_FLOOR, run_diagnosis
from verify.runner import PrefillResult, StepResult, run_trace

VOCAB = 16
BROKEN_LAYER = 5


def _logits(order: list[int]) -> torch.Tensor:
    """Logits whose ranking is `order` (best first); every other token below all of them."""
    out = torch.zeros(VOCAB)
    for rank, tok in enumerate(order):
        out[tok] = float(len(order) - rank)
    return out


def test_rank_counts_only_strictly_larger_logits():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert [rank_of(logits, t) for t in range(4)] == [4, 1, 1, 3]


def test_gate_accepts_a_near_tie_flip_and_rejects_a_far_one():
    ref = torch.stack([_logits([1, 2, 3]), _logits([4, 5, 6]), _logits([7, 8, 9])])
    near = torch.stack([_logits([1, 2, 3]), _logits([5, 4, 6]), _logits([7, 8, 9])])
    far_order = [10, 11, 12, 13, 14, 7]   # HF's choice 7 is 6th here; ours (10) is 4th in HF's
    far = torch.stack([_logits([1, 2, 3]), _logits([4, 5, 6]), _logits(far_order)])

    ok = gate_prompt(ref, near)
    assert ok.passed and ok.steps == 3 and ok.agreements == 2
    assert ok.first_divergence.step == 1 and ok.first_divergence.hf_token_rank_in_ours == 2

    bad = gate_prompt(ref, far)
    d = bad.first_divergence
    assert not bad.passed and d.step == 2 and (d.hf_token, d.our_token) == (7, 10)
    # One side's choice outside the other's top k fails the step, even if the other way holds.
    assert d.hf_token_rank_in_ours == TOP_K + 1 and d.our_token_rank_in_hf == 4 and not d.ok


class ScriptedRunner:
    """Prefers token (position + 1) % VOCAB; records what it was fed and where."""

    def __init__(self):
        self.calls: list[tuple[str, object, int]] = []

    def _next(self, pos: int) -> torch.Tensor:
        return _logits([(pos + 1) % VOCAB])

    def prefill(self, tokens, keep_layers=False):
        self.calls.append(("prefill", list(tokens), 0))
        return PrefillResult(self._next(len(tokens) - 1))

    def decode_step(self, token, pos):
        self.calls.append(("decode", token, pos))
        return StepResult(self._next(pos))


def test_teacher_forcing_feeds_the_given_tokens_at_consecutive_positions():
    runner = ScriptedRunner()
    trace = run_trace(runner, [0, 1, 2], n_tokens=99, end_ids=set(), forced=[9, 8, 7])
    assert trace.tokens == [9, 8, 7] and trace.logits.shape == (3, VOCAB)
    assert runner.calls == [("prefill", [0, 1, 2], 0), ("decode", 9, 3), ("decode", 8, 4)]
    assert trace.logits.argmax(dim=1).tolist() == [3, 4, 5]


def test_greedy_trace_stops_after_choosing_an_end_token():
    trace = run_trace(ScriptedRunner(), [0, 1, 2], n_tokens=10, end_ids={5})
    assert trace.tokens == [3, 4, 5]


@pytest.fixture
def reports(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_NPU_REPORTS", str(tmp_path))
    return tmp_path


def _report(folder, kind: str) -> dict:
    (path,) = folder.glob(f"{kind}-*.json")
    assert path.with_suffix(".md").is_file()
    return json.loads(path.read_text())


def test_make_verify_passes_on_the_embedded_model(reports, capsys):
    rc = verify_cli.main(["--model", EMBEDDED, "--device", "sim", "--prompts", "2", "--n-tokens", "32"])
    out = capsys.readouterr().out
    assert rc == 0 and "[verify] PASS" in out.splitlines()
    data = _report(reports, "verify")
    assert data["passed"] and data["device"] == "sim" and len(data["prompts"]) == 2
    for p in data["prompts"]:
        assert 1 <= p["steps"] <= 32 and len(p["hf_tokens"]) == p["steps"]
        assert p["agreements"] + len(p["divergences"]) == p["steps"]
    assert sum(p["steps"] for p in data["prompts"]) > 32   # the set elicits long answers


@pytest.fixture
def dropped_residual(monkeypatch):
    """Layer BROKEN_LAYER loses its skip connection (prefill and decode): out = f(x) instead of x + f(x)."""
    original = KernelCache.load_and_run

    def load_and_run(self, name, inputs, bo_key, **limits):
        if bo_key.endswith(f"_L{BROKEN_LAYER}") and "x_res" in inputs:
            inputs = {**inputs, "x_res": torch.zeros_like(inputs["x_res"])}
        return original(self, name, inputs, bo_key, **limits)

    monkeypatch.setattr(KernelCache, "load_and_run", load_and_run)


def test_a_dropped_residual_fails_the_gate_and_diagnosis_names_its_layer(reports, capsys, dropped_residual):
    rc = verify_cli.main(["--model", EMBEDDED, "--device", "sim", "--prompts", "1", "--n-tokens", "4"])
    assert rc == 1 and "[verify] FAIL" in capsys.readouterr().out.splitlines()
    assert not _report(reports, "verify")["prompts"][0]["passed"]

    run = run_diagnosis(EMBEDDED, "sim", log=lambda _: None)
    assert run.first_low_layer == BROKEN_LAYER
    assert all(min(d.cosine, d.worst_row_cosine) >= COSINE_FLOOR for d in run.layers[:BROKEN_LAYER])
    assert _report(reports, "diagnosis")["first_low_layer"] == BROKEN_LAYER


def _interleaved_rope(half_split):
    """RoPE on adjacent pairs (2j, 2j+1), llama.cpp's layout, built from the correct kernel."""

    def rope(launch, x, lut, out):
        d = launch.p("head_dim")
        to_half = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
        half_split(launch, x.view(-1, d)[:, to_half].reshape(x.shape), lut, out)
        out.view(-1, d)[:, to_half] = out.view(-1, d).clone()

    return rope


def test_interleaved_rope_is_located_at_the_first_layer(reports, monkeypatch):
    monkeypatch.setitem(sim_ops.OPS, "rope", _interleaved_rope(sim_ops.OPS["rope"]))
    run = run_diagnosis(EMBEDDED, "sim", log=lambda _: None)
    assert run.first_low_layer == 0
    # Position 0 is not rotated at all, so only the other rows can show the bug.
    assert run.layers[0].worst_row_cosine < COSINE_FLOOR


@pytest.mark.slow
def test_llama1b_shape_every_layer_matches_hf(reports):
    run = run_diagnosis(LLAMA1B_SHAPE, "sim", log=lambda _: None)
    assert len(run.layers) == LlamaConfig.from_json(run.prep.folder).num_hidden_layers
    assert [i for i, d in enumerate(run.layers) if d.cosine < COSINE_FLOOR] == []
    assert run.first_low_layer is None      # no row of any layer under the floor either
    assert run.our_top1 == run.hf_top1 or run.hf_top1_rank_in_ours <= TOP_K


def test_head_dim_128_and_an_untied_head_match_hf_layer_by_layer_and_token_by_token(reports, capsys):
    """The 3B's and 8B's attention and head at the tiny scale (`tiny-hd128`): every layer's
    prefill against HF's, then the verification gate on generated tokens."""
    run = run_diagnosis(TINY_HD128, "sim", log=lambda _: None)
    assert run.first_low_layer is None and not [d for d in run.layers if d.cosine < COSINE_FLOOR]
    rc = verify_cli.main(["--model", TINY_HD128, "--device", "sim", "--prompts", "1", "--n-tokens", "12"])
    assert rc == 0 and "[verify] PASS" in capsys.readouterr().out.splitlines()
