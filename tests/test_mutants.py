"""The mutation suite: a fixed sample of mutants of the tiny model's stitched modules, each of
which verify-mlir's checks must catch unless a rule proves it equivalent or `expected.py`
gives the reason it gets through today."""
from __future__ import annotations

import pytest

from kernel_builder import groups
from llama_base.config import LlamaConfig
from llama_runtime.checkpoints.resolve import TINY, TINY_HD128, resolve_checkpoint
from multi_launch_builder.compile import compile_group_mlir
from verify.mutants.operators import mutants
from llama_base.group_contract import FUSED_KIND
from verify.mutants.run import Outcome, check, check_all, run, suite_cases, summary, well_formed


def _cfg() -> LlamaConfig:
    return resolve_checkpoint(TINY).config


def test_every_sampled_computation_changing_mutant_is_killed():
    outcomes = run(_cfg(), per_operator=2, seed=0, log=lambda *_: None, resident=False)
    text, ok = summary(outcomes)
    assert ok, text
    killed = sum(o.verdict == "killed" for o in outcomes)
    assert killed >= 0.8 * len(outcomes), text
    # every check takes part: a suite whose kills all came from one stage would test little
    assert {o.stage for o in outcomes if o.killed} == {"validator", "interpreter", "comparison"}


def test_a_malformed_mutant_is_discarded_not_killed():
    case = suite_cases(_cfg())[0]
    m = mutants(compile_group_mlir(case.group), case.group)[0]
    broken = type(m)(m.operator, m.site, m.text.replace("arith.constant", "arith.constant %nowhere", 1))
    assert well_formed(broken.text)
    o = check(case, broken)
    assert o.stage == "malformed" and not o.killed and o.verdict == "malformed"


def test_every_operator_finds_sites_and_mutants_stay_well_formed():
    cfg = _cfg()
    g = groups.build_group("flash_attn", cfg, 32, 64)
    ms = mutants(compile_group_mlir(g), g)
    ops = {m.operator for m in ms}
    for want in ("dma_offset_addi1", "dma_size_divui2", "dma_stride_muli2", "loop_ub", "loop_step", "herd_halve_x",
                 "call_delete", "call_swap_args", "call_scalar_plus1", "dma_delete", "swap_operands", "cmpi_widen",
                 "const_int_plus1", "argmap_swap"):
        assert want in ops, want
    assert all(not well_formed(m.text) for m in ms[::7])


def test_an_equivalence_rule_that_is_wrong_is_reported():
    case = suite_cases(_cfg())[0]
    m = next(m for m in mutants(compile_group_mlir(case.group), case.group) if m.operator == "dma_delete")
    wrong = type(m)(m.operator, m.site, m.text, equivalent="claimed without proof")
    assert Outcome(case.group.name, wrong, "interpreter").verdict == "RULE BROKEN"


def test_the_q4nx_groups_mutants_are_killed():
    """The groups `QUANT=q4nx` changes: the packed slots' DMAs (values, then scales and mins,
    in one run of bytes) and the dequantizing kernels' calls are where a mistake would hide
    from the bf16 suite."""
    outcomes = run(_cfg(), per_operator=1, seed=0, log=lambda *_: None, quant="q4nx")
    text, ok = summary(outcomes)
    assert ok, text
    mutated = {c.group.name: c.group for c in suite_cases(_cfg(), "q4nx")}
    assert {o.group for o in outcomes} == set(mutated)
    # the groups q4nx leaves in bf16 (attention) are the bf16 suite's, not mutated twice
    assert all(g.quantized for g in mutated.values()), sorted(mutated)
    assert sum(o.verdict == "killed" for o in outcomes) >= 0.8 * len(outcomes), text
    assert {o.stage for o in outcomes if o.killed} == {"validator", "interpreter", "comparison"}


def test_a_constant_that_changes_no_value_is_told_from_one_that_does():
    """On the tiny shapes a Q4NX row of 256 columns is one block: its GEMV's block loop runs
    once, at 0, so the block width and the byte stride may grow by one with no effect. The
    down projection's rows (1024 columns) are four blocks: there the same constants matter."""
    g = groups.build_group("o_gemv_ffn", _cfg(), 1, quant="q4nx")
    by_launch = {}
    for m in (m for m in mutants(compile_group_mlir(g), g) if m.operator == "const_int_plus1"):
        launch, what = m.site.split(":const.")
        by_launch.setdefault(launch, {})[what.split("@")[0]] = m
    assert by_launch["up_proj"]["%up_proj_c256"].equivalent and by_launch["up_proj"]["%up_proj_c20"].equivalent
    assert not by_launch["down_proj"]["%down_proj_c256"].equivalent
    assert not by_launch["down_proj"]["%down_proj_c20"].equivalent
    # the prefill GEMM's unit-row destination stride, and a stride that is applied
    p = groups.build_group("o_ffn", _cfg(), 32, quant="q4nx")
    pm = {m.site.split(":const.")[1].split("@")[0]: m for m in mutants(compile_group_mlir(p), p)
          if m.operator == "const_int_plus1" and m.site.startswith("down_proj:")}
    assert pm["%down_proj_c1280"].equivalent and not pm["%down_proj_c20480_1"].equivalent


@pytest.mark.parametrize("model", [TINY, TINY_HD128])
def test_decode_attention_one_position_off_is_killed(model):
    """The fused decode's live length one position (or one chunk) off wherever the module
    computes it from `pos` (the loaded scalar, its index, the chunk count), and its mask's
    bound one off either way: each reads a position too many or too few at one of verify-mlir's
    positions, and verify-mlir's checks on the fused decode kill it; at head_dim 64 and 128."""
    cfg = resolve_checkpoint(model).config
    cases = [c for c in suite_cases(cfg) if c.group.kind == FUSED_KIND]
    chunk = {64: 64, 128: 32}[cfg.head_dim]               # a chunk's K and V fill the same L1 either way
    assert [c.q_start for c in cases] == [0, chunk - 1, chunk, chunk + 1, 512 + chunk // 3, 1023]
    text = compile_group_mlir(cases[0].group)
    ms = [m for m in mutants(text, cases[0].group) if m.site.startswith("L0_attn:")
          and (m.operator.startswith("position_") or (m.operator.startswith("call_scalar_") and "attn_mask" in m.site))]
    assert {m.operator for m in ms} == {"position_plus1", "position_minus1", "call_scalar_plus1", "call_scalar_minus1"}
    assert len(ms) == 12
    outcomes = [check_all(cases, m) for m in ms]
    assert all(o.killed for o in outcomes), [(o.mutant.operator, o.mutant.site, o.detail) for o in outcomes if not o.killed]


@pytest.mark.slow
def test_every_sampled_mutant_of_the_resident_designs_is_killed():
    """`make mutants`' sample of the resident-KV designs: the fused decode's own launches (its
    first layer's KV append, decode attention and merge) at every position verify-mlir runs,
    and prefill attention appending to the resident cache at its offsets."""
    outcomes = [o for o in run(_cfg(), per_operator=2, seed=0, kinds=(FUSED_KIND, "flash_attn"), log=lambda *_: None)
                if o.group.startswith(FUSED_KIND) or "resident" in o.group]
    text, ok = summary(outcomes)
    assert ok, text
    assert {o.group.split("_c")[0] for o in outcomes} == {FUSED_KIND, "flash_attn_s32"}
    assert sum(o.verdict == "killed" for o in outcomes) >= 0.8 * len(outcomes), text
