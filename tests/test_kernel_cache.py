"""KernelCache: compile once, persist, rebuild what is damaged, and honour the BO contract."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from kernel_builder.groups import build_group, lm_head_gemv
from llama_base.group_contract import Role
from llama_base.errors import KernelCacheError
from verify import reference as ref
from llama_base.rope import generate_rope_lut
from llama_runtime.engine.weight_slots import static_tensors
from npu_runtime.cache import KernelCache
from npu_runtime.profiler import Profiler
from npu_runtime.sim.device import SimDevice

SEQ = 128


def _cache(path, **kw):
    return KernelCache(SimDevice(), path, **kw)


def _ready(kc, g, weights, layers=(0,)):
    kc.compile_and_cache(g)
    for layer in layers:
        kc.preload(g.name, f"{g.name}_L{layer}", static_tensors(g, weights, layer), share_key=f"L{layer}")


def _layer(weights, layer, **inputs):
    """A group's input and weight slots by name, for `reference.assert_group_matches`."""
    return {**weights.layers[layer].by_name(), **inputs}


def test_timed_call_writes_only_the_input_bytes(tiny_config, tiny_weights, tmp_path):
    kc = _cache(tmp_path)
    g = build_group("rms_gemms_rope", tiny_config, SEQ)
    _ready(kc, g, tiny_weights)
    x = torch.randn(SEQ, tiny_config.hidden_size).to(torch.bfloat16)
    lut = generate_rope_lut(tiny_config, SEQ)
    kc.load_and_run(g.name, {"x": x, "rope_lut": lut}, f"{g.name}_L0")      # first call
    before = kc.device.counters.snapshot()
    kc.load_and_run(g.name, {"x": x, "rope_lut": lut}, f"{g.name}_L0")
    moved = kc.device.counters.since(before)
    inputs = sum(s.nbytes for s in g.with_role(Role.INPUT))
    outputs = sum(s.nbytes for s in g.with_role(Role.OUTPUT))
    assert moved.bytes_to_device == inputs == x.numel() * 2 + lut.numel() * 2
    assert moved.bytes_from_device == outputs
    assert moved.bos_allocated == 0
    # a 10-token prompt in the same bucket moves only its rows
    before = kc.device.counters.snapshot()
    kc.load_and_run(g.name, {"x": x[:10], "rope_lut": lut[:10]}, f"{g.name}_L0", rows=10)
    assert kc.device.counters.since(before).bytes_to_device == inputs * 10 // SEQ


def test_each_group_matches_the_reference(tiny_config, tiny_weights, tmp_path):
    """A layer through the KernelCache, each group's outputs against `reference` (on the native
    path where the CPU has one; test_device runs every path), attention on the projections'."""
    cfg = tiny_config
    kc = _cache(tmp_path)
    x = (torch.randn(SEQ, cfg.hidden_size)).to(torch.bfloat16)
    lut = generate_rope_lut(cfg, SEQ)
    g1 = build_group("rms_gemms_rope", cfg, SEQ)
    _ready(kc, g1, tiny_weights, layers=(1,))
    out1 = kc.load_and_run(g1.name, {"x": x, "rope_lut": lut}, f"{g1.name}_L1")
    ref.assert_group_matches(cfg, g1, _layer(tiny_weights, 1, x=x, rope_lut=lut), out1)
    g2 = build_group("flash_attn", cfg, SEQ)
    _ready(kc, g2, tiny_weights, layers=(1,))
    head_major = lambda t: t.view(SEQ, cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)  # noqa: E731
    inputs = {"q": out1["q"], "k_cache": head_major(out1["k"]), "v_cache": head_major(out1["v"]),
              "q_start": torch.tensor([0], dtype=torch.int32)}
    attn = kc.load_and_run(g2.name, inputs, f"{g2.name}_L1")
    ref.assert_group_matches(cfg, g2, inputs, attn)
    attn = attn["attn"]
    g3 = build_group("o_ffn", cfg, SEQ)
    _ready(kc, g3, tiny_weights, layers=(1,))
    out3 = kc.load_and_run(g3.name, {"attn": attn, "x_res": x}, f"{g3.name}_L1")
    ref.assert_group_matches(cfg, g3, _layer(tiny_weights, 1, attn=attn, x_res=x), out3)
    # decode groups on one row, the LM head over all partitions
    g4, g5, g6 = build_group("rms_gemv_rope", cfg), build_group("o_gemv_ffn", cfg), lm_head_gemv(cfg)
    for g in (g4, g5):
        _ready(kc, g, tiny_weights, layers=(1,))
    kc.compile_and_cache(g6)
    head = static_tensors(g6, tiny_weights, None)
    kc.preload(g6.name, g6.name, head)
    o4 = kc.load_and_run(g4.name, {"x": x[7], "rope_lut": lut[7]}, f"{g4.name}_L1")
    ref.assert_group_matches(cfg, g4, _layer(tiny_weights, 1, x=x[7], rope_lut=lut[7]), o4)
    o5 = kc.load_and_run(g5.name, {"attn": attn[7], "x_res": x[7]}, f"{g5.name}_L1")
    ref.assert_group_matches(cfg, g5, _layer(tiny_weights, 1, attn=attn[7], x_res=x[7]), o5)
    o6 = kc.load_and_run(g6.name, {"x": x[3]}, g6.name)
    ref.assert_group_matches(cfg, g6, {**head, "x": x[3]}, o6)
    logits = torch.cat([o6[f"logits_p{i}"] for i in range(8)])
    assert logits.shape[0] >= cfg.vocab_size
    assert not logits[cfg.vocab_size:].any()     # zero-padded rows of the last partition


def test_per_layer_sets_keep_weights_distinct_and_phases_share_them(tiny_config, tiny_weights, tmp_path):
    kc = _cache(tmp_path)
    cfg = tiny_config
    g = build_group("rms_gemv_rope", cfg)
    _ready(kc, g, tiny_weights, layers=(0, 1))
    x, lut = torch.randn(cfg.hidden_size).to(torch.bfloat16), generate_rope_lut(cfg, 1)[0]
    q0 = kc.load_and_run(g.name, {"x": x, "rope_lut": lut}, f"{g.name}_L0")["q"].clone()
    q1 = kc.load_and_run(g.name, {"x": x, "rope_lut": lut}, f"{g.name}_L1")["q"].clone()
    assert not torch.equal(q0, q1)
    ref.assert_group_matches(cfg, g, _layer(tiny_weights, 1, x=x, rope_lut=lut), {"q": q1})
    static_before = kc.resident_bytes()["static"]
    gp = build_group("rms_gemms_rope", cfg, SEQ)
    _ready(kc, gp, tiny_weights, layers=(0, 1))          # prefill reuses the decode weight BOs
    assert kc.resident_bytes()["static"] == static_before


def test_second_cache_loads_from_disk_without_compiling(tiny_config, tmp_path):
    groups = [build_group("o_ffn", tiny_config, SEQ), build_group("rms_gemv_rope", tiny_config)]
    first = _cache(tmp_path)
    for g in groups:
        first.compile_and_cache(g)
    assert first.stats.compiled == 2
    second = _cache(tmp_path)
    for g in groups:
        second.compile_and_cache(g)
    assert second.stats.compiled == 0 and second.stats.loaded_from_disk == 2


def test_damaged_or_stale_entries_are_rebuilt(tiny_config, tmp_path):
    g = build_group("o_gemv_ffn", tiny_config)
    path = _cache(tmp_path).compile_and_cache(g)
    program = path / "program.json"
    program.write_text(program.read_text()[:-20])          # truncated artifact
    kc = _cache(tmp_path)
    assert kc.compile_and_cache(g) == path
    assert kc.stats.rebuilt == 1 and json.loads(program.read_text())["kind"] == "o_gemv_ffn"
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "key": "0" * 64}))   # a stale key
    kc = _cache(tmp_path)
    kc.compile_and_cache(g)
    assert kc.stats.rebuilt == 1
    kc = _cache(tmp_path)
    kc.artifacts._builder_hash = "0" * 64                   # other builder sources: an older build
    new_path = kc.compile_and_cache(g)
    assert new_path != path and kc.stats.compiled == 1 and not path.exists()


def test_models_sharing_group_names_keep_their_entries(tiny_config, tmp_path):
    """A group's name does not say its shapes: models alternating in one cache each keep
    their entries, up to DECLARATIONS_KEPT declarations a group, the least recently used going
    first."""
    from npu_runtime.artifacts import DECLARATIONS_KEPT

    models = [build_group("o_gemv_ffn", dataclasses.replace(tiny_config, rms_norm_eps=1e-6 * (i + 1)))
              for i in range(DECLARATIONS_KEPT + 1)]
    paths = [_cache(tmp_path).compile_and_cache(g) for g in models[:2]]
    kc = _cache(tmp_path)
    assert kc.compile_and_cache(models[0]) == paths[0] and kc.stats.compiled == 0
    for g in models[2:DECLARATIONS_KEPT]:
        _cache(tmp_path).compile_and_cache(g)
    kc = _cache(tmp_path)            # model 1 is now the least recently used; model 0 was used again
    kc.compile_and_cache(models[DECLARATIONS_KEPT])
    assert kc.stats.compiled == 1 and paths[0].exists() and not paths[1].exists()
    kept = [_cache(tmp_path) for _ in models]
    for g, c in zip(models, kept):
        c.compile_and_cache(g)
    assert [c.stats.compiled for c in kept][:2] == [0, 1]


def test_another_toolchain_s_entry_is_reused_unless_a_refresh_is_asked_for(tiny_config, tmp_path):
    """The toolchain that built an entry is recorded, not keyed: a machine with the artifacts
    but another compiler (or none) uses them; `refresh_toolchain` rebuilds them."""
    g = build_group("o_gemv_ffn", tiny_config)
    path = _cache(tmp_path).compile_and_cache(g)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["toolchain"] == SimDevice().toolchain_description()
    (path / "manifest.json").write_text(json.dumps({**manifest, "toolchain": "another compiler"}))
    kc = _cache(tmp_path)
    assert kc.compile_and_cache(g) == path and kc.stats.loaded_from_disk == 1 and kc.stats.rebuilt == 0
    kc = _cache(tmp_path, refresh_toolchain=True)
    assert kc.compile_and_cache(g) == path and kc.stats.rebuilt == 1
    assert json.loads((path / "manifest.json").read_text())["toolchain"] == SimDevice().toolchain_description()
    kc = _cache(tmp_path, refresh_toolchain=True)        # refreshed: the recorded toolchain is this one
    kc.compile_and_cache(g)
    assert kc.stats.loaded_from_disk == 1 and kc.stats.rebuilt == 0


def test_run_only_cache_refuses_to_compile(tiny_config, tmp_path):
    kc = _cache(tmp_path, allow_compile=False)
    with pytest.raises(KernelCacheError, match="make compile"):
        kc.compile_and_cache(build_group("o_gemv_ffn", tiny_config))


def test_run_before_preload_is_refused(tiny_config, tmp_path):
    kc = _cache(tmp_path)
    g = build_group("o_gemv_ffn", tiny_config)
    kc.compile_and_cache(g)
    with pytest.raises(KernelCacheError, match="preload"):
        kc.load_and_run(g.name, {}, "x")


def _compile_in_process(args):
    path, cfg_dict = args
    from llama_base.config import LlamaConfig

    kc = KernelCache(SimDevice(), Path(path))
    entry = kc.compile_and_cache(build_group("o_ffn", LlamaConfig(**cfg_dict), SEQ))
    return str(entry), kc.stats.compiled


def test_concurrent_compiles_do_not_corrupt_the_cache(tiny_config, tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.map(_compile_in_process, [(str(tmp_path), tiny_config.__dict__)] * 2)
    entries = {r[0] for r in results}
    assert len(entries) == 1 and sum(r[1] for r in results) == 1   # one built, the other waited and reused
    assert not list(tmp_path.glob(".tmp-*"))
    kc = _cache(tmp_path)
    kc.compile_and_cache(build_group("o_ffn", tiny_config, SEQ))
    assert kc.stats.loaded_from_disk == 1


def test_profiler_records_write_run_read(tiny_config, tiny_weights, tmp_path):
    prof = Profiler()
    kc = _cache(tmp_path, profiler=prof)
    g = build_group("o_gemv_ffn", tiny_config)
    _ready(kc, g, tiny_weights)
    for _ in range(3):
        kc.load_and_run(g.name, {"attn": torch.zeros(tiny_config.q_dim, dtype=torch.bfloat16),
                                 "x_res": torch.ones(tiny_config.hidden_size, dtype=torch.bfloat16)}, f"{g.name}_L0")
    s = prof.groups["o_gemv_ffn"]
    assert s.calls == 3 and s.run_s > 0 and s.write_s > 0 and s.read_s > 0
    assert "o_gemv_ffn" in prof.table()
