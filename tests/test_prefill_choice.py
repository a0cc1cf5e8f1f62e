"""Where a Q4NX prefill dequantizes on the NPU: the cost model's three choices, and the one
docs/profile.md draws from them."""
from __future__ import annotations

from dataclasses import replace

import pytest

from llama_base import group_contract
from llama_base import q4nx
from llama_base.config import LlamaConfig
from npu_runtime.cost.hardware import FITTED
from npu_runtime.cost.model import estimate_phases, launch_components, phase_groups
from npu_runtime.cost.prefill_choice import compare, dequant_work, main, projections

LLAMA_1B = LlamaConfig()


def test_expanding_a_matrix_reads_its_q4nx_bytes_and_writes_bf16_once():
    w = dequant_work(8192, 2048)
    assert w.l3_read == q4nx.nbytes(8192, 2048) == 8192 * 2048 * 5 // 8
    assert w.l3_write == 8192 * 2048 * 2 and w.vector == 8192 * 2048
    parts = launch_components(w, FITTED)
    assert max(parts, key=parts.get) == "l3"     # moving 2.6 bytes a weight, not expanding it, takes the time


def test_the_projections_are_the_groups_weight_products():
    g = phase_groups(LLAMA_1B, 2048, "q4nx")
    shapes = {g[k].launches[i].name: nk for k in group_contract.PREFILL_KINDS for i, nk in projections(g[k]).items()}
    cfg = LLAMA_1B
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, f = cfg.hidden_size, cfg.intermediate_size
    assert shapes == {"q_gemm": (q, h), "k_gemm": (kv, h), "v_gemm": (kv, h), "o_proj": (h, q),
                      "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}


def test_the_choices_are_priced_from_the_built_groups():
    """Fused is the q4nx modules' own estimate; at load is the bf16 prefill with the Q4NX head;
    per call pays, on top of at load, one expansion of every projection of every layer: a cost
    that follows the layers and the bytes moved, not the prompt."""
    res = compare(LLAMA_1B, 128)
    q4, bf = estimate_phases(LLAMA_1B, FITTED, 128, "q4nx"), estimate_phases(LLAMA_1B, FITTED, 128, "bf16")
    assert res["fused"].ttft_s == pytest.approx(q4.ttft_s)
    assert res["at load"].ttft_s == pytest.approx(
        bf.ttft_s - bf.groups["lm_head_gemv"].seconds + q4.groups["lm_head_gemv"].seconds)
    expand = res["per call"].ttft_s - res["at load"].ttft_s
    assert expand > 0 and res["per call"].projection_s - res["at load"].projection_s == pytest.approx(expand)
    # Independent of the prompt, proportional to the layers...
    assert compare(LLAMA_1B, 2048)["per call"].ttft_s - compare(LLAMA_1B, 2048)["at load"].ttft_s == \
        pytest.approx(expand)
    half = compare(replace(LLAMA_1B, num_hidden_layers=LLAMA_1B.num_hidden_layers // 2), 128)
    assert 2 * (half["per call"].ttft_s - half["at load"].ttft_s) == pytest.approx(expand)
    # ...and at the memory's pace: every layer reads its Q4NX matrices and writes them in bf16
    # through DDR, and nothing else takes longer (DMA set-up adds about 1 %).
    cfg = LLAMA_1B
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, f = cfg.hidden_size, cfg.intermediate_size
    matrices = [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]
    moved = cfg.num_hidden_layers * sum(q4nx.nbytes(n, k) + n * k * 2 for n, k in matrices)
    assert moved / FITTED.l3_bandwidth <= expand < 1.05 * moved / FITTED.l3_bandwidth
    assert 0 < res["fused"].projection_s < res["fused"].ttft_s
    # bytes held beyond Q4NX: none; the largest matrix in bf16; every layer's matrices in bf16
    assert res["fused"].extra_bytes == 0
    assert res["per call"].extra_bytes == f * h * 2
    assert res["at load"].extra_bytes == cfg.num_hidden_layers * sum(n * k for n, k in matrices) * 2


def _fastest(prompt: int, scale: float) -> str:
    res = compare(LLAMA_1B, prompt, replace(FITTED, gemm_efficiency=FITTED.gemm_efficiency * scale))
    return min(res.values(), key=lambda r: r.ttft_s).choice


def test_the_documented_choice_holds():
    """docs/profile.md keeps fused: fastest at 128 tokens with the fitted constants, behind
    holding bf16 copies at 2048 only while the cores are as slow as fitted, fastest everywhere
    once they are 1.5 times faster."""
    assert _fastest(128, 1.0) == "fused"
    assert _fastest(2048, 1.0) == "at load"
    assert _fastest(128, 1.5) == "fused" and _fastest(2048, 1.5) == "fused"


def test_the_report_prints_every_choice(capsys):
    assert main(["--prompts", "128"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:3] == "| 0"]
    assert len(rows) == 3 and all(" | 128 | " in r for r in rows)     # one per efficiency scale
    assert "weights held beyond Q4NX" in out
    assert all(c in out for c in ("fused", "per call", "at load"))


def test_prompt_lengths_that_are_not_numbers_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--prompts", "128,lots"])
    assert exit_.value.code == 2 and "'128,lots' is not a comma-separated list" in capsys.readouterr().err


def test_layers_that_keep_weights_in_bf16_cost_their_bytes():
    """A Q4_K_M file's layers whose down projection stays bf16: each adds its bf16 GEMV's time to
    a decode step, and every layer counts its own variant."""
    layers = LLAMA_1B.num_hidden_layers
    uniform = estimate_phases(LLAMA_1B, FITTED, 128, "q4nx")
    same = estimate_phases(LLAMA_1B, FITTED, 128, "q4nx", [frozenset()] * layers)
    one = estimate_phases(LLAMA_1B, FITTED, 128, "q4nx", [frozenset({"w_down"})] + [frozenset()] * (layers - 1))
    half = estimate_phases(LLAMA_1B, FITTED, 128, "q4nx", [frozenset({"w_down"}), frozenset()] * (layers // 2))
    bf16 = estimate_phases(LLAMA_1B, FITTED, 128, "bf16")
    assert same.decode_token_s == uniform.decode_token_s and same.ttft_s == uniform.ttft_s
    step = one.decode_token_s - uniform.decode_token_s
    assert step > 0 and half.decode_token_s - uniform.decode_token_s == pytest.approx(layers // 2 * step)
    assert half.decode_token_s < bf16.decode_token_s
    assert half.groups["o_gemv_ffn"].group == "o_gemv_ffn_q4nx_bf16_w_down"    # a tie: layer 0's
    assert one.groups["o_gemv_ffn"].group == "o_gemv_ffn_q4nx"         # most layers' variant
