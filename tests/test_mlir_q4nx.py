"""The Q4NX groups' modules: every group of every shape the project runs builds, stitches,
validates and cross-checks (the validation includes the hardware rules: every DMA moves whole
32-bit words, which a byte format makes easy to get wrong); weight slots are their bytes."""
from __future__ import annotations

import re

import pytest
from conftest import TINY
from mlir_samples import BUCKET, CONFIGS

from kernel_builder import backend_presets as presets
from kernel_builder import externs, groups
from kernel_builder.mlir import KernelShapeError, build_launch, gemm, gemm_q4nx, gemv_q4nx
from llama_base import q4nx
from llama_runtime.checkpoints import builtin
from multi_launch_builder.compile import compile_group_mlir
from multi_launch_builder.mlir_validate import validate_group_module

QUANT = q4nx.NAME


@pytest.fixture(scope="module")
def configs():
    """The Llama-3.2-1B shape, SmolLM2 (hidden 576: a row's last block is 64 wide), the test
    suite's TINY and the interpreter's tiny model."""
    return {**CONFIGS, "tiny_tests": TINY, "tiny_model": builtin.tiny_config(builtin.ensure_embedded_model())}


def q4nx_groups(cfg):
    return groups.all_groups(cfg, (BUCKET, 4 * BUCKET), quant=QUANT)


def test_every_q4nx_group_module_validates_against_its_declaration(configs):
    for cfg in configs.values():
        for g in q4nx_groups(cfg):
            text = compile_group_mlir(g)
            s = validate_group_module(text, g)
            assert [u.name for u in s.launches] == [f"{l.name}_launch" for l in g.launches]
            assert s.externs == {k.symbol: k.link_object for l in g.launches for k in externs.externs_for_launch(l)}
            for slot in g.slots:
                if slot.quantized:
                    assert f"memref<{q4nx.nbytes(*slot.shape)}xi8>" in s.arg_types


def test_q4nx_groups_use_the_q4nx_ops_and_only_their_kernels(configs):
    g = groups.build_group("o_gemv_ffn", configs["llama32_1b"], quant=QUANT)
    text = compile_group_mlir(g)
    assert not re.search(r"memref<\d+x\d+xbf16>", text)        # decode's only 2-D buffers would be weights
    assert set(re.findall(r"func\.func private @(\w+)", text)) == {
        "gemv_q4nx_t256_k2048", "gemv_q4nx_t256_k8192", "silu_and_mul_bf16_n1024"}
    prefill = compile_group_mlir(groups.build_group("o_ffn", configs["llama32_1b"], BUCKET, quant=QUANT))
    assert set(re.findall(r"func\.func private @(\w+)", prefill)) == {
        "dequant_q4nx_n32_k64", "silu_and_mul_bf16_n1024"}


def _launch(cfg, kind, name, seq=BUCKET):
    g = groups.build_group(kind, cfg, seq, quant=QUANT) if kind in groups.PREFILL_KINDS else \
        groups.build_group(kind, cfg, quant=QUANT)
    return g, next(l for l in g.launches if l.name == name)


def test_a_narrower_last_block_gets_its_own_dma_and_call(configs):
    """SmolLM2: K = 576 = 2 x 256 + 64."""
    g, l = _launch(configs["smollm2"], "o_gemv_ffn", "o_proj")
    text = build_launch(g, l)
    tail = q4nx.BYTES_PER_COL * 64
    assert len(re.findall(rf"%c{tail} = arith.constant {tail} : index", text)) == 1
    assert re.search(r"func\.call @gemv_q4nx_t256_k576\(.*, %c512_i32, %c64_i32\)", text)
    g, l = _launch(configs["smollm2"], "o_ffn", "o_proj")
    assert l.p("tile_k_l2") == 576          # one panel of the whole K: blocks 256, 256, 64
    text = build_launch(g, l)
    assert len(re.findall(r"func\.call @dequant_q4nx", text)) == 2     # the 256-wide run and the 64-wide one


def test_llama_tilings_fit_l1_and_l2():
    cfg = CONFIGS["llama32_1b"]
    for kind, seq in (("rms_gemv_rope", 1), ("o_gemv_ffn", 1), ("lm_head_gemv", 1),
                      ("rms_gemms_rope", BUCKET), ("o_ffn", BUCKET), ("o_ffn", 2048)):
        g = groups.build_group(kind, cfg, seq, quant=QUANT)
        for l in g.launches:
            p = l.param_dict
            if l.op == "gemv_q4nx":
                assert presets.gemv_q4nx_l1_bytes(p["tile_k"], p["K"]) <= presets.L1_BUDGET
                assert (p["M"] // q4nx.ROWS) % p["herd"][0] == 0
            elif l.op == "gemm_q4nx":
                assert presets.gemm_q4nx_l1_bytes(p["tile_m"], p["tile_n"], p["tile_k"]) <= presets.L1_BUDGET
                hm, hn = p["herd"][::-1] if p.get("m_axis") else p["herd"]
                mb, nb = hm * p["tile_m"], hn * p["tile_n"]
                split = p["tile_k_l2"] < p["K"]
                assert presets.gemm_q4nx_l2_bytes(mb, nb, p["tile_k_l2"], split) <= presets.L2_BYTES
                assert p["tile_k_l2"] in presets.q4nx_k_steps(p["K"], p["tile_k"])


def test_prompt_rows_walk_the_herd_dimension_the_tiling_names(configs):
    """At 2048 prompt rows, rows of A run along the array's 4 rows (`m_axis` 1), so 32 rows fit
    a core where 16 did along its 8 columns: the herd stays the array's [8, 4], the A panel holds
    4 tiles of rows and the W panel 8 tiles of columns."""
    g, l = _launch(configs["llama32_1b"], "o_ffn", "gate_proj", seq=2048)
    p = l.param_dict
    assert (p["herd"], p["m_axis"], p["tile_m"], p["tile_n"]) == ((8, 4), 1, 32, 32)
    text = build_launch(g, l)
    assert f"memref<{4 * 32}x{p['tile_k_l2']}xbf16, 1 : i32>" in text                 # A panel
    assert f"memref<{q4nx.nbytes(8 * 32, p['tile_k_l2'])}xi8, 1 : i32>" in text        # W panel
    assert f"memref<{4 * 32}x{8 * 32}xf32, 1 : i32>" in text                           # partial sums
    bad = groups.Launch(l.name, l.op, l.reads, l.writes, tuple((k, 2 if k == "m_axis" else v) for k, v in l.params))
    with pytest.raises(KernelShapeError, match="m_axis"):
        gemm_q4nx.build(bad, [g.slot(a) for a in l.args])


def test_a_builder_refuses_the_other_weight_format(configs):
    cfg = configs["llama32_1b"]
    q, lq = _launch(cfg, "o_ffn", "o_proj")
    b = groups.build_group("o_ffn", cfg, BUCKET)
    lb = next(l for l in b.launches if l.name == "o_proj")
    with pytest.raises(KernelShapeError, match="not bf16"):
        gemm.build(lb, [q.slot(a) for a in lq.args])
    with pytest.raises(KernelShapeError, match="not Q4NX"):
        gemm_q4nx.build(lq, [b.slot(a) for a in lb.args])
    d, ld = _launch(cfg, "o_gemv_ffn", "o_proj")
    bad = groups.Launch(ld.name, ld.op, ld.reads, ld.writes,
                        tuple((k, 128 if k == "tile_k" else v) for k, v in ld.params))
    with pytest.raises(KernelShapeError, match="tile_k"):
        gemv_q4nx.build(bad, [d.slot(a) for a in ld.args])


def test_the_llama_lm_head_partitions_keep_every_core_of_the_gemv_busy():
    cfg = CONFIGS["llama32_1b"]
    rows = groups.lm_head_rows(cfg, QUANT)
    g = groups.lm_head_gemv(cfg, QUANT)
    assert all(l.p("herd") == (presets.ARRAY_COLS, 1) for l in g.launches)
    assert rows % (q4nx.ROWS * presets.ARRAY_COLS) == 0
    assert cfg.vocab_size <= groups.LM_HEAD_PARTITIONS * rows < 1.01 * cfg.vocab_size
    assert groups.lm_head_rows(TINY, QUANT) == q4nx.ROWS       # one row-block: no padding to a herd
