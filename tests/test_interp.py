"""The MLIR-AIR interpreter device: the stitched modules, executed, compute what `reference`
says, `make verify-mlir` finds them in agreement with the simulated device, and every check the
interpreter makes fires on the mistake it is there for."""
from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kernel_builder import backend_presets as presets
from kernel_builder import groups
from kernel_builder.fused_groups import decode_windows, fused_decode
from llama_base.group_contract import FUSED_KIND, KernelGroup, Role
from llama_base import q4nx
from llama_runtime.checkpoints import builtin
from verify import reference as ref
from llama_runtime.checkpoints.resolve import TINY
from multi_launch_builder.compile import compile_group_mlir
from npu_runtime.interp.device import InterpDevice
from npu_runtime.interp.machine import DTYPES, InterpError, Machine
from npu_runtime.interp.program import load_program
from npu_runtime.api import Sync
from npu_runtime.sim.device import SimDevice
from verify import mlir as verify_mlir

BUCKET = 64


@pytest.fixture(scope="module")
def tiny():
    return builtin.tiny_config(builtin.ensure_embedded_model())


def test_tiny_shape_exercises_what_real_shapes_do(tiny):
    """Several herd cores, K streamed through L2 in steps, a launch grid, GQA, several buckets."""
    ffn = groups.build_group("o_ffn", tiny, BUCKET)
    down = next(l for l in ffn.launches if l.name == "down_proj").param_dict
    gate = next(l for l in ffn.launches if l.name == "gate_proj").param_dict
    assert down["tile_k_l2"] < down["K"]
    assert gate["N"] // (gate["herd"][1] * gate["tile_n"]) > 1
    assert tiny.num_attention_heads > tiny.num_key_value_heads
    assert len(groups.prefill_buckets(tiny)) > 2


# The NPU's Q4NX GEMV sums q·x in f32 where the decode contract (`q4nx.gemv_reference`) sums q
# times x's group fixed point exactly: the two differ by the fixed point's rounding of a group's
# small values, which moves a bf16 rounding of up to 35 % of a decode group's values (the tiny
# model's down projection, whose SwiGLU inputs span many octaves in a group), each by at most
# one ulp of its row's largest. Prefill's dequantizing GEMM is the reference's in its weights.
Q4NX_DECODE_FRACTION = 0.4


def _slots(group, data, text=None):
    """Every slot the group's launches store (outputs and intermediates), run by the interpreter."""
    got = verify_mlir.run_group(InterpDevice(), group, text or compile_group_mlir(group), data,
                                roles=(Role.OUTPUT, Role.INTERMEDIATE))
    return {name: torch.from_numpy(v).bfloat16() for name, v in got.items()}


def _interpreted(cfg, case_list, weights=None):
    """Each case's group run on verify-mlir's inputs and checked against the reference
    (`assert_group_matches`); the kinds run."""
    for case in case_list:
        data = verify_mlir.inputs(case, weights=weights)
        decode_q4nx = case.group.quant == q4nx.NAME and case.group.seq_len == 1
        ref.assert_group_matches(cfg, case.group, data, _slots(case.group, data),
                                 Q4NX_DECODE_FRACTION if decode_q4nx else ref.CHAINED)
    return [c.group.name.split("_s")[0].removesuffix("_q4nx") for c in case_list]


def test_every_group_kind_matches_the_reference(tiny):
    kinds = _interpreted(tiny, cases := verify_mlir.cases(tiny, BUCKET))
    assert set(kinds) == {"rms_gemms_rope", "flash_attn", "o_ffn", "rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv"}
    assert any(c.q_start for c in cases)              # attention at an offset


def test_verify_mlir_finds_every_group_kind_in_agreement_with_the_simulated_device(tiny):
    rows = [verify_mlir.compare(c) for c in verify_mlir.cases(tiny, BUCKET)]
    bad = [(r.name, r.worst, r.error) for r in rows if not r.passed]
    assert not bad
    assert all(r.compared > 0 for r in rows) and len(rows) == len(verify_mlir.cases(tiny, BUCKET))


def test_every_q4nx_group_kind_matches_the_reference(tiny):
    """The Q4NX groups on the tiny model's own weights, quantized: the fused GEMVs and the
    dequantizing GEMMs executed as MLIR."""
    from llama_runtime.checkpoints.loader import load_weights

    weights = load_weights(builtin.ensure_tiny_checkpoint())
    case_list = verify_mlir.cases(tiny, BUCKET, q4nx.NAME)
    assert set(_interpreted(tiny, case_list, weights)) == {
        "rms_gemms_rope", "flash_attn", "o_ffn", "rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv"}
    assert sum(c.group.name.endswith("_q4nx") for c in case_list) == 2 * len(groups.prefill_buckets(tiny, BUCKET)) + 3


def test_q4nx_group_variants_with_bf16_weights_match_the_reference(tiny):
    """The groups of a layer that keeps some weights in bf16 (a Q4_K_M file's V and down
    projections): bf16 and Q4NX GEMVs and GEMMs side by side in one module, executed."""
    from llama_runtime.checkpoints.loader import load_weights

    weights = load_weights(builtin.ensure_tiny_checkpoint())
    wide = frozenset({"wv", "w_down"})
    case_list = [c for c in verify_mlir.cases(tiny, BUCKET, q4nx.NAME, (frozenset(), wide)) if c.group.wide]
    assert {c.group.wide for c in case_list} == {("wv",), ("w_down",)}
    assert len(case_list) == 2 * len(groups.prefill_buckets(tiny, BUCKET)) + 2
    assert {l.op for c in case_list for l in c.group.launches} >= {"gemv", "gemv_q4nx", "gemm", "gemm_q4nx"}
    _interpreted(tiny, case_list, weights)


def test_q4nx_groups_at_smollm2_shapes_match_the_reference():
    """The embedded model (SmolLM2: hidden 576 = 2 x 256 + 64, FFN 1536) on its real weights,
    quantized: rows whose last Q4NX block is narrower, and a down projection whose K takes
    several L2 steps with partial sums, executed as MLIR."""
    from llama_runtime.checkpoints.loader import load_weights
    from llama_base.config import LlamaConfig

    folder = builtin.ensure_embedded_model()
    cfg = LlamaConfig.from_json(folder)
    assert cfg.hidden_size % q4nx.COLS and cfg.intermediate_size > 2 * q4nx.COLS
    down = next(l for l in groups.build_group("o_ffn", cfg, 32, quant=q4nx.NAME).launches if l.name == "down_proj")
    assert down.p("tile_k_l2") < down.p("K")
    assert len(_interpreted(cfg, verify_mlir.cases(cfg, 32, q4nx.NAME), load_weights(folder))) == 6


def test_verify_mlir_runs_the_q4nx_groups_and_their_generation(capsys):
    assert verify_mlir.main(["--quant", q4nx.NAME, "--max-seq", "32", "--n-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "lm_head_gemv_q4nx" in out and "[verify-mlir] generation: " in out and "skipped" not in out
    assert "PASS" in out
    assert "[device] simulated NPU2 (CPU kernels: " in out and "the NPU's numbers)" in out   # generation's side
    # Every quantized group twice: on the model's weights and on the synthetic ones, which
    # make an FFN branch weigh as much as its residual.
    names = [line.split("  ")[0].strip() for line in out.splitlines()]
    quantized = [n for n in names if n.endswith(q4nx.NAME)]
    assert quantized and all(f"{n} {verify_mlir.SYNTHETIC}" in names for n in quantized)


def _shift_dma(text, rows=2):
    """The Q GEMV's weight slab `rows` rows further down: the last core reads past the matrix
    (two rows keep the slab's bf16 output on a word boundary; one moves it half a word)."""
    return re.sub(r"(%q_gemv_i_1 = arith.addi %q_gemv_i, %q_gemv_m : index)",
                  rf"%q_gemv_i_0 = arith.addi %q_gemv_i, %q_gemv_m : index\n"
                  rf"            %q_gemv_shift = arith.constant {rows} : index\n"
                  rf"            %q_gemv_i_1 = arith.addi %q_gemv_i_0, %q_gemv_shift : index", text, count=1)


def _skip_last_tile(text):
    """Each core of the first LM-head partition stops one slab early: rows stay unwritten."""
    m = re.search(r"( *)scf.for %gemv_p0_m = (%\w+) to (%gemv_p0_c(\d+)) step (%gemv_p0_c(\d+))", text)
    indent, ub, step = m.group(1), int(m.group(4)), int(m.group(6))
    assert ub > step
    shorter = f"{indent}%gemv_p0_short = arith.constant {ub - step} : index\n"
    return text.replace(m.group(0), shorter + m.group(0).replace(m.group(3), "%gemv_p0_short"), 1)


def _swap_extern_args(text):
    """SwiGLU's output tile passed where the gate tile goes: the kernel reads a tile nobody wrote."""
    return re.sub(r"func.call @(silu_and_mul\w+)\((%\w+), (%\w+), (%\w+)\)", r"func.call @\1(\4, \3, \2)",
                  text, count=1)


def _oversize_l1(text):
    """The GEMV weight slab's L1 type at 16x its rows: no longer fits a core's data memory."""
    m = re.search(r"%q_gemv_w_l1 = memref.alloc\(\) : (memref<(\d+)x(\d+)xbf16, 2 : i32>)", text)
    return text.replace(m.group(1), f"memref<{int(m.group(2)) * 16}x{m.group(3)}xbf16, 2 : i32>")


def _race(text):
    """Every core writes the first core's output rows: a race on the NPU."""
    return text.replace("%q_gemv_i = arith.muli %q_gemv_tx, ", "%q_gemv_i = arith.muli %q_gemv_c0, ", 1)


def _foreign_op(text):
    return text.replace("math.rsqrt", "math.sqrt", 1)


def _l2_in_herd(text):
    """An L2 buffer allocated by each core of the SwiGLU herd."""
    m = re.search(r"( *)(%swiglu_a_l1 = memref.alloc\(\) : .*)", text)
    return text.replace(m.group(0), f"{m.group(0)}\n{m.group(1)}%swiglu_l2 = memref.alloc() : memref<64xbf16, 1 : i32>", 1)


MUTATIONS = {
    "shifted_dma_offset": ("rms_gemv_rope", _shift_dma,
                           r"q_gemv_launch.*herd q_gemv_herd core \(7,0\).*dma_memcpy_nd: source .* accessed outside"),
    "half_word_dma": ("rms_gemv_rope", lambda t: _shift_dma(t, rows=1),
                      r"q_gemv_launch.*core \(0,0\).*dma_memcpy_nd: destination q_raw \(shim tile\): .*not on a 32-bit word"),
    "herd_skips_last_tile": ("lm_head_gemv", _skip_last_tile,
                             r"launch gemv_p0_launch.*leaves \d+ of \d+ elements of logits_p0 unwritten"),
    "extern_args_swapped": ("o_gemv_ffn", _swap_extern_args,
                            r"swiglu_launch.*mlir_validate.call: reads \d+ element\(s\) of .* never written"),
    "oversized_l1_tile": ("rms_gemv_rope", _oversize_l1,
                          r"core \(0,0\), memref.alloc: core holds \d+ bytes of L1 \(double buffers counted twice\), over"),
    "two_cores_same_rows": ("rms_gemv_rope", _race, r"core \(1,0\).*writes elements of q_raw that another core"),
    "unknown_op": ("rms_gemv_rope", _foreign_op, r"rms_gemv_rope: .*math.sqrt: op not implemented"),
    "swiglu_into_up": ("o_gemv_ffn", lambda t: t.replace('"air.dma_memcpy_nd"(%swiglu_act_2,', '"air.dma_memcpy_nd"(%swiglu_up_2,'),
                       r"launch swiglu_launch, herd swiglu_herd core \(0,0\), air.dma_memcpy_nd: writes up, "
                       r"which this launch does not declare"),
    "rmsnorm_over_its_input": ("o_gemv_ffn", lambda t: t.replace('"air.dma_memcpy_nd"(%rmsnorm_normed_2,',
                                                                 '"air.dma_memcpy_nd"(%rmsnorm_h1_2,'),
                               r"launch rmsnorm_launch, .*dma_memcpy_nd: writes h1, which this launch does not declare"),
    "l2_in_a_herd": ("o_gemv_ffn", _l2_in_herd,
                     r"herd swiglu_herd core \(0,0\), memref.alloc: allocates L2 .* inside a herd"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_check_catches_its_mistake(tiny, mutation):
    """A module with one deliberate mistake fails on the interpreter with the check's message."""
    kind, mutate, message = MUTATIONS[mutation]
    group = groups.build_group(kind, tiny)
    text = compile_group_mlir(group)
    changed = mutate(text)
    assert changed != text, "the mutation did not apply"
    data = verify_mlir.inputs(verify_mlir.Case(group))
    verify_mlir.run_group(InterpDevice(), group, text, data)      # the unmutated module runs clean
    with pytest.raises(InterpError, match=message):
        verify_mlir.run_group(InterpDevice(), group, changed, data)


@pytest.fixture(scope="module")
def embedded_pair():
    from llama_runtime.generation.session import build_session

    return [build_session("embedded", d, max_context=64, log=lambda *_: None, decode="layers") for d in ("sim", "interp")]


def test_one_decode_step_of_the_embedded_model_runs_through_the_interpreter(embedded_pair):
    """At the real SmolLM2 shapes (hidden 576, 30 layers): the decode groups and the LM head,
    executed as MLIR, give the simulated device's logits on the same KV cache."""
    from llama_runtime.engine.decode import decode_step
    from llama_runtime.engine.prefill import prefill

    sim, interp = embedded_pair
    ids = sim.encode("What is the capital of Japan?")
    first = int(torch.argmax(prefill(sim.model, ids)))
    interp.model.kv.k.copy_(sim.model.kv.k)
    interp.model.kv.v.copy_(sim.model.kv.v)
    runs = interp.device.counters.runs
    ref = decode_step(sim.model, first, len(ids)).float()
    got = decode_step(interp.model, first, len(ids)).float()
    assert interp.device.counters.runs - runs == 2 * sim.config.num_hidden_layers + 1
    assert int(torch.argmax(got)) == int(torch.argmax(ref))
    assert (got - ref).abs().max() <= verify_mlir.TOLERANCE * 2 * ref.abs().max()


def test_greedy_tokens_match_the_simulated_device_on_the_tiny_model():
    ok, report = verify_mlir.generation(TINY, 6, "What is the capital of Japan?")
    assert ok, report


def test_greedy_tokens_match_the_simulated_device_with_the_fused_decode():
    """`DECODE=fused` on both devices: prefill attention appends to the resident cache and each
    token is one call of the fused group, the interpreter executing their modules."""
    ok, report = verify_mlir.generation(TINY, 6, "What is the capital of Japan?", decode="fused")
    assert ok, report


_LOOP_REDUCTION = """
#id = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
#out = affine_map<(d0, d1, d2) -> (d1)>
func.func @loop_reduction(%a: memref<3x4x5xf32>, %mx: memref<4xf32>, %decay: memref<4xf32>) {
  linalg.generic {indexing_maps = [#id, #out, #out], iterator_types = ["reduction", "parallel", "reduction"]}
      ins(%a : memref<3x4x5xf32>) outs(%mx, %decay : memref<4xf32>, memref<4xf32>) {
  ^bb0(%x: f32, %m: f32, %d: f32):
    %top = arith.maximumf %m, %x : f32
    %half = arith.constant 0.5 : f32
    %kept = arith.mulf %d, %half : f32
    %next = arith.addf %kept, %x : f32
    linalg.yield %top, %next : f32, f32
  }
  return
}
"""


def test_a_reduction_other_than_a_sum_runs_as_its_loop_nest():
    """Two outputs, a maximum, and a running value that reads the accumulator (d ← d/2 + x, which
    depends on the order): the interpreter carries them through the reduction dims in loop order."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    mx = np.full(4, -np.inf, np.float32)
    decay = np.ones(4, np.float32)
    expect_mx, expect_decay = a.max(axis=(0, 2)), decay.copy()
    for i in range(3):                       # d0 outer, d2 inner: the map's order
        for k in range(5):
            expect_decay = expect_decay * np.float32(0.5) + a[i, :, k]
    Machine(load_program(_LOOP_REDUCTION), "loop_reduction", {}).run([a.reshape(-1), mx, decay])
    np.testing.assert_array_equal(mx, expect_mx)
    np.testing.assert_array_equal(decay, expect_decay)


_DMA = ('"air.dma_memcpy_nd"(%b, %c{o}, %c{n}, %c1, %a, %c{o}, %c{n}, %c1) {{operandSegmentSizes = '
        'array<i32: 0, 1, 1, 1, 1, 1, 1, 1, 1>, static_dst_offsets = array<i64: -9223372036854775808>, '
        'static_dst_sizes = array<i64: -9223372036854775808>, static_dst_strides = array<i64: -9223372036854775808>, '
        'static_src_offsets = array<i64: -9223372036854775808>, static_src_sizes = array<i64: -9223372036854775808>, '
        'static_src_strides = array<i64: -9223372036854775808>}} : (memref<8xbf16>, index, index, index, '
        'memref<8xbf16>, index, index, index) -> ()')


@pytest.mark.parametrize("offset,count,ok", [(0, 4, True), (2, 6, True), (0, 3, False), (1, 2, False)])
def test_a_dma_of_part_of_a_word_is_refused(offset, count, ok):
    """bf16 elements: two to a 32-bit word, so a run must start and end on an even element."""
    consts = "".join(f"  %c{v} = arith.constant {v} : index\n" for v in sorted({0, 1, offset, count}))
    text = (f"func.func @words(%a: memref<8xbf16>, %b: memref<8xbf16>) {{\n{consts}"
            f"  {_DMA.format(o=offset, n=count)}\n  return\n}}\n")
    a, b = np.arange(8, dtype=np.float32).astype(DTYPES["bf16"]), np.zeros(8, DTYPES["bf16"])
    machine = Machine(load_program(text), "words", {})
    if ok:
        machine.run([a, b])
        np.testing.assert_array_equal(b[offset:offset + count], a[offset:offset + count])
    else:
        with pytest.raises(InterpError, match="not on a 32-bit word|not whole 32-bit words"):
            machine.run([a, b])


def test_a_herd_linking_the_wrong_object_is_refused(tiny):
    """The declaration and the herd name an object that does not define the kernel: the
    validator and the interpreter's load both refuse it, naming herd and kernel."""
    from kernel_builder import externs
    from multi_launch_builder.mlir_validate import MlirValidationError, validate_group_module
    from npu_runtime.api import DeviceError

    group = groups.build_group("o_gemv_ffn", tiny)
    swiglu = next(l for l in group.launches if l.op == "swiglu")
    obj = externs.externs_for_launch(swiglu)[0].link_object
    text = compile_group_mlir(group)
    wrong = text.replace(f'link_with = "{obj}"', 'link_with = "gemv_other.o"')
    assert wrong.count("gemv_other.o") == 2                # the declaration and the herd
    with pytest.raises(MlirValidationError, match=rf"herd swiglu_herd calls @\w+ \(defined in '{obj}'\) but links 'gemv_other.o'"):
        validate_group_module(wrong, group)
    data = verify_mlir.inputs(verify_mlir.Case(group))
    with pytest.raises(DeviceError, match=rf"o_gemv_ffn: herd swiglu_herd calls @\w+, defined in '{obj}', but links 'gemv_other.o'"):
        verify_mlir.run_group(InterpDevice(), group, wrong, data)


def test_interpreter_entries_are_keyed_by_the_module_text(tiny, tmp_path, monkeypatch):
    """A module that changes with no builder source changing (here: text appended by a stand-in
    for the pipeline) is a new entry holding the new text, never the old entry reused."""
    from npu_runtime.artifacts import ArtifactCache
    from npu_runtime.cache import KernelCache

    group = groups.build_group("lm_head_gemv", tiny)
    first = KernelCache(InterpDevice(), tmp_path).compile_and_cache(group)
    again = KernelCache(InterpDevice(), tmp_path)
    assert again.compile_and_cache(group) == first and again.stats.loaded_from_disk == 1
    monkeypatch.setattr(ArtifactCache, "_mlir", staticmethod(lambda g: compile_group_mlir(g) + "// edited\n"))
    edited = KernelCache(InterpDevice(), tmp_path).compile_and_cache(group)
    assert edited != first
    assert (edited / "group.mlir").read_text().endswith("// edited\n")


def test_the_comparison_catches_a_one_percent_systematic_error():
    """A 1 % scale or offset over all elements fails; bf16 rounding noise of an ulp does not."""
    rng = np.random.default_rng(5)
    ref = torch.randn(32, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).float().numpy()
    bf16 = lambda a: torch.from_numpy(a).to(torch.bfloat16).float().numpy()   # noqa: E731
    ulp = np.abs(ref) * 2.0 ** -7 * rng.choice([-1, 0, 0, 1], ref.shape)
    assert verify_mlir.systematic_error(ref, bf16(ref + ulp)) <= 1
    assert verify_mlir.systematic_error(ref, bf16(ref * 1.01)) > 1
    assert verify_mlir.systematic_error(ref, bf16(ref * 1.005)) > 1
    assert verify_mlir.systematic_error(ref, bf16(ref + 0.01 * np.sqrt((ref ** 2).mean()))) > 1
    small = ref[0, :128]                                         # a decode output: 128 elements
    assert verify_mlir.systematic_error(small, bf16(small * 1.01)) > 1


RMSNORM_MISTAKES = {
    "divides_by_248": ("2.560000000e+02 : f32", "2.480000000e+02 : f32"),
    "eps_1e-2": ("1.000000000e-05 : f32", "1.000000000e-02 : f32"),
}


@pytest.mark.parametrize("mistake", RMSNORM_MISTAKES)
def test_a_norm_off_by_a_constant_fails_the_group_check(tiny, monkeypatch, mistake):
    """Each passed verify-mlir's per-element bound alone; the fitted scale of the outputs does not,
    nor does the reference's bound on the normed row."""
    old, new = RMSNORM_MISTAKES[mistake]
    assert tiny.hidden_size == 256 and tiny.rms_norm_eps == 1e-5
    real = verify_mlir.compile_group_mlir
    monkeypatch.setattr(verify_mlir, "compile_group_mlir", lambda g: real(g).replace(old, new))
    assert old in real(groups.build_group("rms_gemv_rope", tiny))
    group = groups.build_group("rms_gemv_rope", tiny)
    row = verify_mlir.compare(verify_mlir.Case(group))
    assert row.worst <= 1 and row.systematic > 1 and not row.passed
    data = verify_mlir.inputs(verify_mlir.Case(group))
    with pytest.raises(AssertionError, match="rms_gemv_rope normed"):      # and the reference's bound at once
        ref.assert_group_matches(tiny, group, data, _slots(group, data, verify_mlir.compile_group_mlir(group)))


def test_a_mask_from_the_key_position_fails_only_at_unaligned_starts(tiny, monkeypatch):
    """The mask call given the key tile's position where the query's belongs agrees with the
    real mask wherever a query tile starts on a key tile (starts 0 and one tile): the
    unaligned starts verify-mlir now runs are what catch it."""
    real = verify_mlir.compile_group_mlir
    mask = re.compile(r"(func\.call @attn_mask_\w+\((%\w+)), (%\w+), (%\w+)\)")
    monkeypatch.setattr(verify_mlir, "compile_group_mlir", lambda g: mask.sub(r"\1, \4, \4)", real(g)))
    seq = groups.prefill_buckets(tiny)[0]
    starts = dict(verify_mlir.attention_starts(seq))
    rows = {}
    for start, n in starts.items():
        ctx = max(seq, groups.context_bucket(start + n, seq, groups.prefill_buckets(tiny)[-1]))
        rows[start] = verify_mlir.compare(verify_mlir.Case(groups.build_group("flash_attn", tiny, seq, ctx), start))
    assert mask.search(real(groups.build_group("flash_attn", tiny, seq))) is not None
    assert verify_mlir.compare(verify_mlir.Case(groups.build_group("flash_attn", tiny, seq))).passed
    assert rows[seq].passed
    assert not any(r.passed for s, r in rows.items() if s % seq)


# ---- the resident-KV designs ------------------------------------------------------------------

def test_verify_mlir_finds_the_resident_designs_in_agreement_with_the_simulated_device(tiny):
    """The fused decode at the first position, around the first chunk boundary, mid-cache and
    at the cache's last position, in a session's window and the whole capacity's; prefill
    attention appending to the resident cache at verify's offsets. Outputs and the caches
    (random before the run) agree."""
    case_list = verify_mlir.resident_cases(tiny, BUCKET)
    fused = [c for c in case_list if c.group.kind == FUSED_KIND]
    capacity = fused[0].group.capacity
    assert {c.q_start for c in fused} >= {0, 63, 64, 65, capacity - 1}
    assert len({c.group.ctx_len for c in fused}) > 1                      # two windows
    assert {c.q_start for c in case_list if c.group.kind == "flash_attn"} == {
        s for s, _ in verify_mlir.attention_starts(groups.prefill_buckets(tiny, BUCKET)[0])}
    rows = [verify_mlir.compare(c) for c in case_list]
    assert not [(r.name, r.worst, r.systematic, r.error) for r in rows if not r.passed]
    assert all(r.compared > 0 for r in rows)


# ---- head_dim 128 and an untied head (Llama-3.2-3B's and Llama-3.1-8B's attention) -----------

@pytest.fixture(scope="module")
def tiny_hd128():
    return builtin.tiny_config(builtin.ensure_embedded_model(), builtin.TINY_HD128_SHAPE)


def test_head_dim_128_groups_agree_with_the_simulated_device(tiny_hd128):
    """Every group kind, prefill attention at verify's offsets and the fused decode around its
    first chunk boundary, at head_dim 128: the attention tilings the larger models take."""
    assert tiny_hd128.head_dim == 128 and not tiny_hd128.tie_word_embeddings
    case_list = verify_mlir.cases(tiny_hd128, BUCKET) + [
        c for c in verify_mlir.resident_cases(tiny_hd128, BUCKET) if c.q_start in (0, 63, 64)]
    assert {c.group.kind for c in case_list} >= {"rms_gemms_rope", "flash_attn", "o_ffn", "rms_gemv_rope",
                                                 "o_gemv_ffn", "lm_head_gemv", FUSED_KIND}
    rows = [verify_mlir.compare(c) for c in case_list]
    assert not [(r.name, r.worst, r.systematic, r.error) for r in rows if not r.passed]
    assert all(r.compared > 0 for r in rows)


def test_head_dim_128_q4nx_groups_on_an_untied_head_match_the_reference(tiny_hd128):
    """The Q4NX groups on the model's own weights, its LM head quantized from a head of its own
    rather than from the embedding table."""
    from llama_runtime.checkpoints.loader import load_weights

    weights = load_weights(builtin.ensure_tiny_checkpoint(builtin.TINY_HD128))
    assert not torch.equal(weights.lm_head, weights.embed)
    case_list = [c for c in verify_mlir.cases(tiny_hd128, BUCKET, q4nx.NAME) if c.group.seq_len in (1, BUCKET)]
    assert set(_interpreted(tiny_hd128, case_list, weights)) == {
        "rms_gemms_rope", "flash_attn", "o_ffn", "rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv"}


def _attention_group(cfg, capacity, window):
    """A token's KV append, decode attention and merge (one layer of the fused decode) as a
    group of their own: q, k, v and pos in, the caches resident, the partial sums in between."""
    fused = fused_decode(cfg, capacity, window=window)
    ops = ("kv_append", "decode_attn", "attn_merge")
    launches = tuple(l for l in fused.launches if l.op in ops and l.name.startswith("L0_"))
    used = {a for l in launches for a in l.args}
    roles = {"L0_q": Role.INPUT, "L0_k": Role.INPUT, "L0_v": Role.INPUT, "L0_attn": Role.OUTPUT}
    slots = tuple(dataclasses.replace(s, role=roles.get(s.name, s.role)) for s in fused.slots if s.name in used)
    g = KernelGroup("decode_attention", 1, slots, launches, ctx_len=window)
    g.validate()
    return g


def _interpret(group, data, partial=True):
    """One interpreter run of `group`'s module: the slots the launches store, and the machine
    (its L3 traffic)."""
    device = InterpDevice()
    text = compile_group_mlir(group)
    with tempfile.TemporaryDirectory() as tmp:
        device.compile(group, Path(tmp), text)
        kernel = device.load(Path(tmp), group)
    if not partial:
        kernel.machine.partial_writes = frozenset()
    bos = [device.bo(s.nbytes) for s in group.slots]
    for s, bo in zip(group.slots, bos):
        if s.name in data:
            bo.write(data[s.name])
            bo.sync(Sync.TO_DEVICE)
    kernel.run(bos)
    out = {}
    for s, bo in zip(group.slots, bos):
        if s.role is not Role.INPUT:
            bo.sync(Sync.FROM_DEVICE)
            out[s.name] = bo.read(s.nbytes).view(s.torch_dtype).float().reshape(s.shape)
    return out, kernel.machine


@pytest.fixture(scope="module")
def decode_attention(tiny):
    capacity = verify_mlir.resident_capacity(tiny)
    chunk = presets.decode_attention_tiling(tiny.num_attention_heads, tiny.num_key_value_heads, tiny.head_dim,
                                            capacity)["chunk"]
    return capacity, chunk, {w: _attention_group(tiny, capacity, w) for w in decode_windows(capacity)[::2]}


def test_decode_attention_at_every_length_class_is_the_simulated_device_s(tiny, decode_attention):
    """Lengths 1, a whole chunk, one past it and two past, an unaligned mid-cache length and
    the whole capacity: the partial sums, their stats, the merged rows and the appended cache
    (random elsewhere, kept) against the simulated device's torch bodies, to f32 summation
    order; a split that saw no chunk holds the fill, 0 and zeros exactly."""
    capacity, chunk, by_window = decode_attention
    group = by_window[capacity]
    for pos in (0, chunk - 1, chunk, chunk + 1, capacity // 2 + 21, capacity - 1):
        data = verify_mlir.inputs(verify_mlir.Case(group, pos))
        got, _ = _interpret(group, data)
        want = verify_mlir.run_group(SimDevice(npu_numerics=True), group, "", data,
                                     (Role.OUTPUT, Role.INTERMEDIATE, Role.STATE))
        for name, w in want.items():
            w = torch.from_numpy(w)
            tol = 2.0 ** -7 * (w.abs() + w.abs().amax(-1, keepdim=True)) + 1e-6
            assert ((got[name] - w).abs() <= tol).all(), (pos, name, float((got[name] - w).abs().max()))
        splits = group.slot("L0_attn_stats").shape[1]
        idle = range((pos + chunk) // chunk, splits)         # splits past the live chunks
        stats = got["L0_attn_stats"]
        assert (stats[:, list(idle), :, 0] == ops_fill()).all() and (stats[:, list(idle), :, 1] == 0).all()
        assert (got["L0_attn_acc"][:, list(idle)] == 0).all()
        k_cache = got["L0_k_cache"]
        assert torch.equal(k_cache[:, pos].bfloat16().reshape(-1), data["L0_k"])
        others = torch.ones(capacity, dtype=torch.bool)
        others[pos] = False
        assert torch.equal(k_cache[:, others].bfloat16(), data["L0_k_cache"][:, others])


def ops_fill() -> float:
    from npu_runtime.sim.ops import MASK_FILL

    return float(torch.tensor(MASK_FILL, dtype=torch.float32))


def test_a_window_changes_the_bytes_read_not_the_numbers(decode_attention):
    """The same token in the staircase's smallest window and in the whole capacity's: equal
    outputs bit for bit, and K and V read for the window's positions only (upstream's form
    moves every chunk of its window each token; the live length sets only what is computed)."""
    capacity, chunk, by_window = decode_attention
    small, whole = min(by_window), capacity
    assert small < whole
    pos = chunk + 1
    runs = {}
    for w in (small, whole):
        group = by_window[w]
        runs[w] = _interpret(group, verify_mlir.inputs(verify_mlir.Case(group, pos)))
    (a, ma), (b, mb) = runs[small], runs[whole]
    for name in a:
        assert torch.equal(a[name], b[name]), name
    kvh, _, d = by_window[whole].slot("L0_k_cache").shape
    assert mb.l3_read_bytes - ma.l3_read_bytes == 2 * kvh * (whole - small) * d * 2      # K and V, bf16
    assert ma.l3_write_bytes == mb.l3_write_bytes


def test_a_state_slot_may_be_written_in_part_and_only_a_state_slot(decode_attention):
    """The KV append writes one position of each cache: the interpreter's coverage check lets a
    launch leave the rest of a `STATE` slot as it was, because the declaration says state; with
    the exemption withdrawn the same run is refused, as a partly written output is."""
    capacity, chunk, by_window = decode_attention
    group = by_window[capacity]
    data = verify_mlir.inputs(verify_mlir.Case(group, 5))
    _interpret(group, data)
    with pytest.raises(InterpError, match=r"L0_kv_append_launch.*leaves \d+ of \d+ elements of L0_k_cache unwritten"):
        _interpret(group, data, partial=False)
