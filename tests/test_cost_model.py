"""The NPU cost model: its counts against the modules, its fit against the published figures."""
from __future__ import annotations

import math

import pytest

from kernel_builder import backend_presets as presets
from kernel_builder import groups
from kernel_builder.groups import Launch, Role, Slot
from llama_base.config import LlamaConfig
from multi_launch_builder.compile import compile_group_mlir
from npu_runtime.cost import calibrate
from npu_runtime.cost.counts import count_module
from npu_runtime.cost.hardware import FITTED
from npu_runtime.cost.model import estimate_group, estimate_phases, format_group
from npu_runtime.cost.tiling import best_gemv, gemv_candidates, gemv_work

TINY = LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   intermediate_size=1024, vocab_size=4096, max_position_embeddings=512)


def _gemv_group(m: int, k: int, cores: int, tile_m: int) -> groups.KernelGroup:
    slots = (Slot("x", (k,), "bf16", Role.INPUT), Slot("w", (m, k), "bf16", Role.STATIC),
             Slot("y", (m,), "bf16", Role.OUTPUT))
    launch = Launch("gemv", "gemv", ("x", "w"), ("y",), (("K", k), ("M", m), ("herd", (cores, 1)), ("tile_m", tile_m)))
    return groups.KernelGroup("lm_head_gemv", 1, slots, (launch,))


@pytest.mark.parametrize("cores,tile_m", [(8, 1), (8, 4), (4, 8), (1, 16)])
def test_the_gemv_closed_form_is_what_the_built_module_moves(cores, tile_m):
    m, k = 256, 512
    (got,) = count_module(compile_group_mlir(_gemv_group(m, k, cores, tile_m)))
    want = gemv_work(m, k, cores, tile_m)
    for f in ("l3_read", "l3_write", "l3_dmas", "macs", "core_macs", "core_dma_bytes", "cores", "columns"):
        assert getattr(got.work, f) == getattr(want, f), f


def test_counts_of_a_prefill_group_follow_its_shapes():
    cfg, seq = TINY, 64
    g = groups.build_group("o_ffn", cfg, seq)
    counts = {c.name: c.work for c in count_module(compile_group_mlir(g))}
    h, f = cfg.hidden_size, cfg.intermediate_size
    assert counts["down_proj_launch"].macs == seq * h * f
    assert counts["gate_proj_launch"].macs == seq * f * h
    # every output element of a launch leaves L1 once
    assert counts["down_proj_launch"].l3_write == seq * h * 2
    assert counts["swiglu_launch"].l3_write == seq * f * 2
    # a GEMM herd spreads its products evenly over the 8x4 array
    hm, hn = presets.GEMM_HERD
    assert counts["down_proj_launch"].core_macs * hm * hn >= seq * h * f
    assert counts["down_proj_launch"].cores == hm * hn


def test_attention_counts_only_the_causal_tiles_and_follow_q_start():
    g = groups.build_group("flash_attn", TINY, 32, 128)
    i32 = next(i for i, s in enumerate(g.slots) if s.dtype == "i32")
    text = compile_group_mlir(g)
    near, = count_module(text, {i32: 0})
    far, = count_module(text, {i32: 96})
    # at position 0 only the first K/V tile is visited; at 96 all four are
    assert far.work.macs == 4 * near.work.macs


def test_group_estimates_add_up_and_print():
    est = estimate_group(groups.build_group("o_gemv_ffn", TINY), FITTED)
    assert est.seconds == pytest.approx(sum(l.seconds for l in est.launches) + FITTED.call_overhead_s)
    text = format_group(est)
    assert "down_proj_launch" in text and "estimate" in text


def test_the_fit_reproduces_the_kept_constants_and_its_errors_are_small():
    cal = calibrate.fit()
    assert cal.gemm_efficiency == pytest.approx(FITTED.gemm_efficiency, rel=0.05)
    assert cal.l3_bandwidth == pytest.approx(FITTED.l3_bandwidth, rel=0.05)
    assert cal.call_overhead_s == pytest.approx(FITTED.call_overhead_s, rel=0.05)
    errs = {e.point.label: e.error for e in calibrate.errors(FITTED)}
    assert abs(errs["Llama-3.2-1B TTFT @2048"]) < 0.05
    assert abs(errs["Llama-3.2-1B decode (12.2 tok/s)"]) < 0.05
    # held out: a model that only fits its calibration points would miss these
    assert abs(errs["SmolLM2-1.7B TTFT @2048"]) < 0.15
    assert abs(errs["SmolLM2-1.7B decode (8.0 tok/s)"]) < 0.15


def test_phases_scale_with_the_prompt_bucket():
    short = estimate_phases(TINY, FITTED, prompt=32)
    long = estimate_phases(TINY, FITTED, prompt=512)
    assert long.ttft_s > short.ttft_s
    assert long.decode_token_s == pytest.approx(short.decode_token_s)


def test_the_down_projection_ranking_names_a_tiling_the_npu_accepts():
    cfg = LlamaConfig()
    m, k = cfg.hidden_size, cfg.intermediate_size
    best = best_gemv(m, k)
    assert best is not None and best.tile_m * 2 % 4 == 0
    assert best.l1_bytes <= presets.L1_BUDGET
    today = presets.gemv_tiling(m, k)
    current = next(c for c in gemv_candidates(m, k) if c.cores == today["herd"][0]
                   and c.tile_m == today["tile_m"] and c.double_buffered)
    assert not current.legal          # today's 1-row slabs write 2-byte outputs
    assert math.isfinite(best.seconds) and best.seconds < 2 * current.seconds


def test_the_interp_profile_ends_with_the_estimate_of_the_groups_it_called():
    from types import SimpleNamespace

    from llama_runtime.profile_report import npu_estimate

    session = SimpleNamespace(config=TINY, model=SimpleNamespace(quant="bf16"),
                              profiler=SimpleNamespace(groups={"o_ffn": None, "o_gemv_ffn": None}))
    text = npu_estimate(session, SimpleNamespace(prompt_tokens=40))
    assert text.startswith("== NPU2 estimate (cost model, not a measurement) ==")
    assert "o_ffn_s64:" in text and "o_gemv_ffn:" in text and "flash_attn" not in text
    assert "estimated on NPU2: TTFT" in text
