"""Every per-kernel module: valid AIR, the launch's data flow, and the extern contract."""
from __future__ import annotations

import dataclasses
import re

import pytest
from mlir_samples import BUCKET, CONFIGS, resident_groups

from kernel_builder import externs, groups
from kernel_builder.mlir import BUILDERS, KernelShapeError, build_launch, kv_append
from kernel_builder.mlir.common import slot_type
from multi_launch_builder.mlir_validate import validate_module


def launches(cfg):
    """Every launch of every group, in every weight format, the resident-KV groups' once per
    distinct launch (their layers repeat one another's)."""
    out = [(g, l) for q in groups.QUANTS for g in groups.all_groups(cfg, (BUCKET,), quant=q) for l in g.launches]
    seen = set()
    for g in (g for q in groups.QUANTS for g in resident_groups(cfg, q, small_window=True)):
        for l in g.launches:
            key = (l.op, l.params, tuple((g.slot(a).shape, g.slot(a).dtype) for a in l.args))
            if key not in seen:
                seen.add(key)
                out.append((g, l))
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_kernel_module_validates_and_moves_what_the_launch_declares(name):
    for g, launch in launches(CONFIGS[name]):
        s = validate_module(build_launch(g, launch))
        assert s.func_name == launch.name
        assert s.arg_types == tuple(slot_type(g.slot(a)) for a in launch.args)
        (use,) = s.launches
        n_reads = len(launch.reads)
        assert use.args == tuple(range(len(launch.args)))
        assert use.reads == set(range(n_reads)), (g.name, launch.name)
        assert use.writes == set(range(n_reads, len(launch.args))), (g.name, launch.name)
        # The KV append's herd is its builder's (one core per KV head); the others' declared.
        herd = launch.p("herd") if launch.op != "kv_append" else kv_append.herd(launch.p("kv_heads"))
        assert use.herds and all(h == tuple(herd) for h in use.herds)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kernel_modules_declare_exactly_the_contracted_externs(name):
    for g, launch in launches(CONFIGS[name]):
        text = build_launch(g, launch)
        want = externs.externs_for_launch(launch)
        declared = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("func.func private")]
        assert declared == [k.declaration() for k in want], (g.name, launch.name)
        for k in want:
            assert f"func.call @{k.symbol}(" in text


def test_every_op_of_every_group_has_a_builder():
    ops = {l.op for _, l in launches(CONFIGS["llama32_1b"])}
    assert ops == set(BUILDERS)


def test_gemm_stages_k_through_l2_and_keeps_partial_sums_only_when_split(tiny_config):
    g = groups.rms_gemms_rope(CONFIGS["llama32_1b"], BUCKET)
    q = next(l for l in g.launches if l.name == "q_gemm")
    p = q.param_dict
    mb, nb = p["herd"][0] * p["tile_m"], p["herd"][1] * p["tile_n"]
    text = build_launch(g, q)
    assert f"memref<{mb}x{p['tile_k_l2']}xbf16, 1 : i32>" in text     # A panel in L2
    assert f"memref<{nb}x{p['tile_k_l2']}xbf16, 1 : i32>" in text     # W panel in L2
    assert f"memref<{p['tile_m']}x{p['tile_k']}xbf16, 2 : i32>" in text  # A tile in L1
    assert p["tile_k_l2"] < p["K"] and f"memref<{mb}x{nb}xf32, 1 : i32>" in text
    whole_k = dataclasses.replace(q, params=tuple((k, p["K"] if k == "tile_k_l2" else v) for k, v in q.params))
    with pytest.raises(KernelShapeError, match="B of L2"):   # a full-K panel does not fit a memory tile
        build_launch(g, whole_k)
    small = groups.rms_gemms_rope(tiny_config, BUCKET)
    q_small = next(l for l in small.launches if l.name == "q_gemm")
    assert q_small.p("tile_k_l2") == q_small.p("K")
    single = build_launch(small, q_small)
    assert "xf32, 1 : i32>" not in single and "scf.if" not in single
    validate_module(single)


def test_attention_calls_the_tile_primitives_in_order():
    g = groups.flash_attn(CONFIGS["llama32_1b"], BUCKET)
    (launch,) = g.launches
    text = build_launch(g, launch)
    calls = re.findall(r"func\.call @attn_(\w+?)_d", text)
    assert calls == ["init", "qk", "mask", "softmax", "pv", "finalize"]


def test_attention_reads_cache_at_an_offset():
    g = groups.flash_attn(CONFIGS["smollm2"], BUCKET, 4 * BUCKET)
    (launch,) = g.launches
    use = validate_module(build_launch(g, launch)).launches[0]
    assert use.reads == {0, 1, 2, 3} and use.writes == {4}


@pytest.mark.parametrize("param, value, message", [
    ("tile_m", 24, "blocks"),            # 8 x 24 rows do not tile M = 128
    ("tile_k_l2", 96, "do not nest"),    # 2048 % 96 != 0
    ("herd", (8,), "two positive sizes"),
])
def test_illegal_gemm_tilings_are_refused(param, value, message):
    g = groups.rms_gemms_rope(CONFIGS["llama32_1b"], BUCKET)
    q = next(l for l in g.launches if l.name == "q_gemm")
    bad = dataclasses.replace(q, params=tuple((k, value if k == param else v) for k, v in q.params))
    with pytest.raises(KernelShapeError, match=message):
        build_launch(g, bad)


def test_elementwise_chunks_must_not_cross_rows():
    g = groups.o_ffn(CONFIGS["smollm2"], BUCKET)
    add = next(l for l in g.launches if l.op == "add")
    bad = dataclasses.replace(add, params=tuple((k, 1024 if k == "tile" else v) for k, v in add.params))
    with pytest.raises(KernelShapeError):
        build_launch(g, bad)


def test_builders_are_deterministic():
    g = groups.o_ffn(CONFIGS["smollm2"], BUCKET)
    assert [build_launch(g, l) for l in g.launches] == [build_launch(g, l) for l in g.launches]
