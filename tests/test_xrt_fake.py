"""The XRT path (`npu_runtime.xrt`) run for real against `fake_pyxrt`: the device, its kernels and
BOs, the KernelCache on the NPU target and a whole greedy generation, checked against the
simulated device's tokens and against the call protocol XRT expects."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from fake_pyxrt import FakeXrt, xclBOSyncDirection

from kernel_builder.groups import build_group
from llama_base.group_contract import Role
from llama_base.errors import KernelCacheError
from llama_runtime.engine.weight_slots import static_tensors
from multi_launch_builder import compile as mlb_compile
from npu_runtime.api import DeviceError, Sync
from npu_runtime.cache import KernelCache
from npu_runtime.devices import open_device
from npu_runtime.sim.device import SimDevice
from npu_runtime.xrt import device as xrt_device

TO_DEV = xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE.name
FROM_DEV = xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE.name


@pytest.fixture
def fake(monkeypatch):
    """pyxrt replaced by the fake, and aircc by a compile that writes the fake's ELF."""
    state = FakeXrt()
    monkeypatch.setitem(sys.modules, "pyxrt", state.module())

    def compile_elf(mlir_path, out_dir, group, objects_dir=None, tc=None):
        assert Path(mlir_path).read_text().startswith(("#", "module")), "the stitched MLIR is compiled"
        state.register(group)
        elf = Path(out_dir) / f"{group.name}.elf"
        elf.write_bytes(state.elf_bytes(group))
        return {"elf": elf, "kernel": f"main:{group.name}"}

    monkeypatch.setattr(mlb_compile, "compile_elf", compile_elf)
    return state


def _ready(kc, g, weights, layer=0):
    kc.compile_and_cache(g)
    kc.preload(g.name, f"{g.name}_L{layer}", static_tensors(g, weights, layer), share_key=f"L{layer}")


def test_probe_and_open_device_take_the_fake_npu(fake):
    assert xrt_device.probe() == (True, "NPU Strix")
    dev = open_device("npu", verbose=False)
    assert isinstance(dev, xrt_device.XrtDevice) and "NPU Strix" in dev.name


def test_a_bo_moves_only_through_sync(fake):
    dev = xrt_device.XrtDevice()
    bo = dev.bo(64)
    bo.write(torch.arange(64, dtype=torch.uint8))
    bo.sync(Sync.TO_DEVICE)
    bo.map().zero_()
    bo.sync(Sync.FROM_DEVICE, 16, offset=8)
    assert bo.map().tolist() == [0] * 8 + list(range(8, 24)) + [0] * 40
    assert dev.counters.bytes_to_device == 64 and dev.counters.bytes_from_device == 16


def test_a_group_runs_on_the_npu_target_as_on_the_simulator(fake, tiny_config, tiny_weights, tmp_path):
    g = build_group("o_gemv_ffn", tiny_config)
    x = torch.randn(tiny_config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    inputs = {"attn": x[: tiny_config.q_dim], "x_res": x}
    outs = []
    for dev in (xrt_device.XrtDevice(), SimDevice()):
        kc = KernelCache(dev, tmp_path)
        _ready(kc, g, tiny_weights)
        outs.append(kc.load_and_run(g.name, inputs, f"{g.name}_L0")["out"].clone())
    assert torch.equal(outs[0], outs[1])
    # one folder per target: neither build removed the other's entry
    assert len(list((tmp_path / "npu").glob(f"{g.name}-*"))) == 1
    assert len(list((tmp_path / "sim").glob(f"{g.name}-*"))) == 1
    npu_entry = next((tmp_path / "npu").glob(f"{g.name}-*"))
    assert json.loads((npu_entry / "npu.json").read_text()) == {"elf": f"{g.name}.elf", "kernel": f"main:{g.name}"}


def test_the_call_protocol(fake, tiny_config, tiny_weights, tmp_path):
    """One BO per argument, inputs synced to the device before a run and outputs back after
    it, kernels opened by `main:<group>`, and static BOs never touched after preload."""
    dev = xrt_device.XrtDevice()
    kc = KernelCache(dev, tmp_path)
    g = build_group("rms_gemv_rope", tiny_config)
    _ready(kc, g, tiny_weights)
    x = torch.ones(tiny_config.hidden_size, dtype=torch.bfloat16)
    lut = torch.ones(tiny_config.head_dim, dtype=torch.bfloat16)
    preloaded = len(fake.calls)
    for _ in range(3):
        kc.load_and_run(g.name, {"x": x, "rope_lut": lut}, f"{g.name}_L0")
    assert ("kernel", f"main:{g.name}") in fake.calls
    calls = fake.calls[preloaded:]
    runs = [i for i, c in enumerate(calls) if c[0] == "run"]
    assert len(runs) == 3
    bo_ids = calls[runs[0]][2]
    assert len(bo_ids) == len(g.slots) == len(set(bo_ids))                  # a BO per argument
    allocated = {c[1]: c[2] for c in fake.calls if c[0] == "bo"}
    assert [allocated[b] for b in bo_ids] == [s.nbytes for s in g.slots]
    statics = {bo_ids[i] for i, s in enumerate(g.slots) if s.role is Role.STATIC}
    inputs = {bo_ids[i] for i, s in enumerate(g.slots) if s.role is Role.INPUT}
    outputs = {bo_ids[i] for i, s in enumerate(g.slots) if s.role is Role.OUTPUT}
    prev = 0
    for r in runs:
        window = calls[prev:r]
        assert {c[1] for c in window if c[0] == "sync" and c[2] == TO_DEV} == inputs
        after = calls[r + 1:(runs + [len(calls)])[runs.index(r) + 1]]
        assert {c[1] for c in after if c[0] == "sync" and c[2] == FROM_DEV} == outputs
        prev = r + 1
    touched = {c[1] for c in calls if c[0] == "sync"}
    assert not touched & statics                                             # weights stay put
    # one run for the BO set, its arguments set once: every later call is start and wait
    assert [c[0] for c in calls].count("run_created") == 1
    assert [c[3] for c in calls if c[0] == "set_arg"] == list(bo_ids)
    # and every static BO was written to the device once, during preload
    assert {c[1] for c in fake.calls[:preloaded] if c[0] == "sync" and c[2] == TO_DEV} >= statics


def test_buckets_share_their_buffers_through_sub_buffers_of_the_declared_size(fake, tiny_config, tiny_weights,
                                                                                tmp_path):
    """Two prefill buckets on the NPU target: the smaller one's arguments are XRT sub-buffers of
    the larger one's BOs, each exactly the size its argument declares, and both compute what
    the simulator computes."""
    groups = [build_group("o_ffn", tiny_config, n) for n in (32, 64)]
    gen = torch.Generator().manual_seed(2)
    attn = torch.randn(64, tiny_config.q_dim, generator=gen).bfloat16()
    x = torch.randn(64, tiny_config.hidden_size, generator=gen).bfloat16()
    outs = {}
    for dev in (xrt_device.XrtDevice(), SimDevice()):
        kc = KernelCache(dev, tmp_path)
        for g in groups:
            kc.compile_and_cache(g)
        for g in groups:
            _ready(kc, g, tiny_weights)
        for g in (groups[0], groups[1], groups[0]):
            n = g.seq_len
            outs.setdefault(dev.kind, []).append(
                kc.load_and_run(g.name, {"attn": attn[:n], "x_res": x[:n]}, f"{g.name}_L0")["out"].clone())
    assert all(torch.equal(a, b) for a, b in zip(outs["npu"], outs["sim"]))
    assert torch.equal(outs["npu"][0], outs["npu"][2])
    sizes = {c[1]: c[2] for c in fake.calls if c[0] in ("bo", "sub_bo")}
    parent_of = {c[1]: c[3] for c in fake.calls if c[0] == "sub_bo"}
    runs = [c for c in fake.calls if c[0] == "run"]
    small, large = runs[0][2], runs[1][2]
    assert [sizes[b] for b in small] == [s.nbytes for s in groups[0].slots]
    assert [sizes[b] for b in large] == [s.nbytes for s in groups[1].slots]
    for i, slot in enumerate(groups[0].slots):
        if slot.role is Role.STATIC:
            assert small[i] == large[i]                                  # one weight BO per layer
        else:
            assert parent_of[small[i]] in large                          # a range of the larger bucket's
    assert len(set(small)) == len(small) and len(set(large)) == len(large)


def test_contexts_are_bounded_and_reopened_on_demand(fake, tiny_config, tiny_weights, tmp_path):
    dev = xrt_device.XrtDevice(max_contexts=2)
    kc = KernelCache(dev, tmp_path)
    kinds = ("rms_gemv_rope", "o_gemv_ffn")
    gs = [build_group(k, tiny_config) for k in kinds] + [build_group("o_ffn", tiny_config, 32)]
    for g in gs:
        _ready(kc, g, tiny_weights)
    feeds = {
        "rms_gemv_rope": {"x": torch.ones(tiny_config.hidden_size, dtype=torch.bfloat16),
                          "rope_lut": torch.ones(tiny_config.head_dim, dtype=torch.bfloat16)},
        "o_gemv_ffn": {"attn": torch.ones(tiny_config.q_dim, dtype=torch.bfloat16),
                       "x_res": torch.ones(tiny_config.hidden_size, dtype=torch.bfloat16)},
        gs[2].name: {"attn": torch.ones(32, tiny_config.q_dim, dtype=torch.bfloat16),
                     "x_res": torch.ones(32, tiny_config.hidden_size, dtype=torch.bfloat16)},
    }
    first = {}
    for _ in range(2):
        for g in gs:
            out = kc.load_and_run(g.name, feeds[g.name], f"{g.name}_L0")
            got = {k: v.clone() for k, v in out.items()}
            if g.name in first:      # a reopened context computes what the first one did
                assert all(torch.equal(got[k], first[g.name][k]) for k in got)
            first[g.name] = got
    assert fake.max_open_contexts == 2 and dev.open_contexts == 2
    assert sum(1 for c in fake.calls if c[0] == "hw_context") > len(gs)     # closed, then reopened
    assert sum(1 for c in fake.calls if c[0] == "context_closed") >= len(gs)
    # a reopened context gets a new run: none outlives the kernel it was made from
    assert sum(1 for c in fake.calls if c[0] == "run_created") == sum(1 for c in fake.calls if c[0] == "kernel")


def test_the_default_context_limit_is_under_the_drivers_and_configurable(fake, monkeypatch):
    assert 1 <= xrt_device.DEFAULT_MAX_HW_CONTEXTS < 16     # amdxdna's hwctx_limit for NPU4-family parts
    assert xrt_device.XrtDevice().max_contexts == xrt_device.DEFAULT_MAX_HW_CONTEXTS
    monkeypatch.setenv(xrt_device.ENV_MAX_HW_CONTEXTS, "3")
    assert xrt_device.XrtDevice().max_contexts == 3
    monkeypatch.setenv(xrt_device.ENV_MAX_HW_CONTEXTS, "0")
    with pytest.raises(ValueError, match=xrt_device.ENV_MAX_HW_CONTEXTS):
        xrt_device.XrtDevice()


def test_an_npu_entry_is_found_without_a_compiler_and_with_another_toolchain(fake, tiny_config, tmp_path,
                                                                             monkeypatch):
    g = build_group("o_gemv_ffn", tiny_config)
    built = KernelCache(xrt_device.XrtDevice(), tmp_path).compile_and_cache(g)
    recorded = json.loads((built / "manifest.json").read_text())["toolchain"]
    assert recorded == mlb_compile.toolchain().stamp()

    class Other:
        def stamp(self):
            return "aircc=/elsewhere/aircc@1;aiecc=none;peano=none"

    monkeypatch.setattr(mlb_compile, "toolchain", Other)
    run_only = KernelCache(xrt_device.XrtDevice(), tmp_path, allow_compile=False)
    assert run_only.compile_and_cache(g) == built and run_only.stats.loaded_from_disk == 1
    again = KernelCache(xrt_device.XrtDevice(), tmp_path)               # another PATH: still found
    assert again.compile_and_cache(g) == built and again.stats.compiled == 0
    refresh = KernelCache(xrt_device.XrtDevice(), tmp_path, refresh_toolchain=True)
    assert refresh.compile_and_cache(g) == built and refresh.stats.rebuilt == 1
    assert json.loads((built / "manifest.json").read_text())["toolchain"] == Other().stamp()


def test_a_failing_load_is_the_xrt_error_not_a_rebuild(fake, tiny_config, tiny_weights, tmp_path):
    g = build_group("o_gemv_ffn", tiny_config)
    KernelCache(xrt_device.XrtDevice(), tmp_path).compile_and_cache(g)
    kc = KernelCache(xrt_device.XrtDevice(), tmp_path)
    kc.compile_and_cache(g)
    fake.fail_elf = "load_axlf: Operation not permitted"
    with pytest.raises(DeviceError, match="Operation not permitted") as e:
        kc.preload(g.name, f"{g.name}_L0", static_tensors(g, tiny_weights, 0))
    assert "\n" not in str(e.value)
    assert kc.stats.compiled == 0 and kc.stats.rebuilt == 0
    assert len(list((tmp_path / "npu").glob(f"{g.name}-*"))) == 1          # the entry is kept


def test_a_run_that_does_not_complete_is_a_device_error(fake, tiny_config, tiny_weights, tmp_path):
    from fake_pyxrt import ert_cmd_state

    kc = KernelCache(xrt_device.XrtDevice(), tmp_path)
    g = build_group("o_gemv_ffn", tiny_config)
    _ready(kc, g, tiny_weights)
    feed = {"attn": torch.zeros(tiny_config.q_dim, dtype=torch.bfloat16),
            "x_res": torch.zeros(tiny_config.hidden_size, dtype=torch.bfloat16)}
    fake.fail_run_state = ert_cmd_state.ERT_CMD_STATE_TIMEOUT
    with pytest.raises(DeviceError, match="did not complete"):
        kc.load_and_run(g.name, feed, f"{g.name}_L0")
    # a run that timed out may still be in flight: the next call does not start it again
    fake.fail_run_state = None
    kc.load_and_run(g.name, feed, f"{g.name}_L0")
    assert [c[0] for c in fake.calls].count("run_created") == 2


def test_without_a_compiler_a_missing_npu_entry_says_so(fake, tiny_config, tmp_path):
    kc = KernelCache(xrt_device.XrtDevice(), tmp_path, allow_compile=False)
    with pytest.raises(KernelCacheError, match="make compile"):
        kc.compile_and_cache(build_group("o_gemv_ffn", tiny_config))


@pytest.mark.slow
def test_greedy_generation_through_xrt_equals_the_simulator(fake, tmp_path):
    from llama_runtime.generation.session import build_session

    kw = dict(max_context=512, buckets=(128,), log=lambda s: None)
    prompt = "The capital of France is"
    tokens = {}
    for device in ("sim", "npu"):
        s = build_session("embedded", device, cache_dir=tmp_path / "kernels", **kw)
        if device == "npu":
            assert isinstance(s.device, xrt_device.XrtDevice)
            statics = [bo for bo in s.kc._statics.values()]
            before = [bo.map().clone() for bo in statics]
            calls_before = len(fake.calls)
        tokens[device] = s.generate(prompt, n_tokens=8).tokens
    assert tokens["npu"] == tokens["sim"] and len(tokens["npu"]) > 0
    assert fake.max_open_contexts <= xrt_device.DEFAULT_MAX_HW_CONTEXTS
    assert {c[1] for c in fake.calls if c[0] == "kernel"} <= {f"main:{n}" for n in fake.groups}
    static_ids = {id(bo._bo) for bo in statics}
    assert not any(c[0] == "sync" and c[1] in static_ids for c in fake.calls[calls_before:])
    assert all(torch.equal(bo.map(), b) for bo, b in zip(statics, before))
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == ["npu", "sim"]


WIDE = (0, "w_down")


def test_layers_of_two_group_variants_decode_without_reopening_a_context(fake, tiny_config, tiny_weights, tmp_path):
    """A model whose layer 0 keeps its down projection in bf16 (a Q4_K_M file's) decodes through
    two variants of `o_gemv_ffn`, layer after layer: within the default context budget each
    keeps its context open from step to step, and the NPU target's logits are the simulator's
    (within rounding: the fake's BOs are not the simulated device's packed Q4NX weights, so
    its kernels take the unpacked path)."""
    from dataclasses import replace

    from llama_runtime.checkpoints import quantize
    from llama_runtime.engine.decode import decode_step
    from llama_runtime.engine.device_model import DeviceModel
    from llama_runtime.engine.prefill import prefill
    from llama_runtime.checkpoints.weights import LayerWeights

    layers = [LayerWeights(**{n: quantize.quantize(t) if t.dim() == 2 and (i, n) != WIDE else t
                              for n, t in lw.by_name().items()}) for i, lw in enumerate(tiny_weights.layers)]
    weights = replace(tiny_weights, layers=layers, lm_head=quantize.quantize(quantize.pad_rows(tiny_weights.lm_head)),
                      quant="q4nx", backing=tiny_weights)
    npu = DeviceModel(KernelCache(xrt_device.XrtDevice(), tmp_path / "npu"), weights, 256, buckets=(32,))
    sim = DeviceModel(KernelCache(SimDevice(), tmp_path / "sim"), weights, 256, buckets=(32,))
    assert [g["o_gemv_ffn"].name for g in npu.decode_groups] == ["o_gemv_ffn_q4nx_bf16_w_down", "o_gemv_ffn_q4nx"]
    ids = list(range(5, 25))
    tok = int(prefill(sim, ids).argmax())
    assert int(prefill(npu, ids).argmax()) == tok
    decode_step(npu, tok, len(ids))
    decode_step(sim, tok, len(ids))
    opened = sum(1 for c in fake.calls if c[0] == "hw_context")
    for pos in range(len(ids) + 1, len(ids) + 4):
        got, want = decode_step(npu, tok, pos), decode_step(sim, tok, pos)
        assert int(got.argmax()) == int(want.argmax())
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999
    assert sum(1 for c in fake.calls if c[0] == "hw_context") == opened
    # The NPU declares that it records nothing: its tokens ran call by call, no recording tried.
    assert npu.kc.device.recorder() is None and npu.recorded_decode is None


def test_the_fused_decode_through_xrt_equals_the_simulator(fake, tmp_path):
    """One XRT run a token, its position written to its input BO, the KV cache BOs never synced
    by the host, and a token past the first window running the next window's kernel over the
    same buffers."""
    from kernel_builder.fused_groups import decode_windows
    from llama_runtime.generation.session import build_session

    kw = dict(max_context=512, buckets=(128,), log=lambda s: None, decode="fused")
    tokens = {}
    for device in ("sim", "npu"):
        s = build_session("embedded", device, cache_dir=tmp_path / "kernels", **kw)
        first = decode_windows(s.model.capacity)[0]
        ids = s.tokenizer.encode_prompt("The capital of France is " * 80, chat=False)[: first - 4]
        assert len(ids) == first - 4
        if device == "npu":
            states = {id(bo._bo) for bo in s.kc._states.values()}
            calls_before = len(fake.calls)
        tokens[device] = s.generate(ids, n_tokens=8, chat=False).tokens
    assert tokens["npu"] == tokens["sim"] and len(tokens["npu"]) == 8
    fused = [c[1] for c in fake.calls[calls_before:] if c[0] == "run" and "fused_decode" in c[1]]
    assert len(fused) == 7                      # one run a decode token (the first came from the prefill)
    assert len(set(fused)) == 2                 # the tokens from `first` on ran the next window's kernel
    assert not any(c[0] == "sync" and c[1] in states for c in fake.calls[calls_before:])
