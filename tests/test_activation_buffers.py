"""Activation memory: the prefill buckets share one set of buffers sized for the largest, every
group's intermediates share one scratch set, and each kernel still gets a BO of the size its
argument declares (a sub-buffer where the shared one is larger)."""
from __future__ import annotations

import pytest
import torch

from kernel_builder.groups import build_group
from llama_base.group_contract import Role
from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.device_model import DeviceModel
from llama_runtime.engine.prefill import prefill
from llama_runtime.engine.weight_slots import static_tensors
from npu_runtime.api import DeviceError, Sync
from npu_runtime.cache import KernelCache, activation_pool
from npu_runtime.sim.device import SimDevice, SimSubBO


def _model(tmp_path, weights, buckets):
    return DeviceModel(KernelCache(SimDevice(), tmp_path), weights, 128, buckets=buckets)


def _activation_bytes_per_group(groups) -> int:
    """What one buffer per (group, slot) would hold: the layout before buckets shared."""
    return sum(s.nbytes for g in groups for s in g.slots if s.role is not Role.STATIC)


def test_buckets_share_one_set_of_activation_buffers_sized_for_the_largest(tiny_weights, tmp_path):
    prompt = list(range(3, 103))                  # 100 tokens: bucket 128
    many = _model(tmp_path / "a", tiny_weights, (32, 64, 128))
    first = prefill(many, prompt).clone()
    for n in (20, 50):                            # buckets 32 and 64 run on the same buffers
        prefill(many, prompt[:n])
    decode_step(many, 5, 50)
    again = prefill(many, prompt).clone()
    assert torch.equal(first, again)              # a smaller bucket's call left nothing behind

    one = _model(tmp_path / "b", tiny_weights, (128,))
    assert torch.equal(prefill(one, prompt), first)
    decode_step(one, 5, 100)
    shared = many.kc.resident_bytes()["activations"]
    assert shared == one.kc.resident_bytes()["activations"]          # the largest bucket's, not the sum
    used = many.all_groups()
    assert shared < _activation_bytes_per_group(used) * 2 // 3
    # every byte the device allocated is a weight or a pool buffer: sub-buffers allocate nothing
    dev = many.kc.device.counters
    assert dev.bytes_allocated == sum(many.kc.resident_bytes().values())


def test_every_kernel_gets_a_bo_of_its_declared_size(tiny_weights, tmp_path):
    m = _model(tmp_path, tiny_weights, (32, 64, 128))
    for n in (20, 50, 100):
        prefill(m, list(range(3, 3 + n)))
    decode_step(m, 5, 100)
    bound = 0
    for s in m.kc._sets.values():
        if s.calls:
            assert [bo.size for bo in s.bos] == [sl.nbytes for sl in s.group.slots], s.group.name
            bound += 1
    assert bound > 0
    # the smaller buckets' buffers are sub-buffers of the largest bucket's
    small, large = m.prefill_groups[32][0].o_ffn, m.prefill_groups[128][0].o_ffn
    for slot in small.slots:
        if slot.role is Role.STATIC:
            continue
        bo = m.kc._acts[(small.name, slot.name)]
        assert isinstance(bo, SimSubBO)
        assert bo.parent is m.kc._pools[activation_pool(small, slot)]
        if slot.role is not Role.INTERMEDIATE:
            assert bo.parent is m.kc._acts[(large.name, slot.name)]


def test_intermediates_are_shared_across_kinds_and_never_within_a_group(tiny_config):
    groups = [build_group(k, tiny_config, 64) for k in ("rms_gemms_rope", "o_ffn")]
    groups += [build_group(k, tiny_config) for k in ("rms_gemv_rope", "o_gemv_ffn")]
    for g in groups:
        pools = [activation_pool(g, s) for s in g.slots if s.role is not Role.STATIC]
        assert len(pools) == len(set(pools)), g.name          # no two slots of one run alias
    scratch = {activation_pool(g, s) for g in groups for s in g.with_role(Role.INTERMEDIATE)}
    assert len(scratch) == max(len(g.with_role(Role.INTERMEDIATE)) for g in groups)
    with pytest.raises(ValueError, match="weight"):
        activation_pool(groups[0], groups[0].slot("wq"))


def test_a_group_compiled_later_that_needs_more_grows_the_pool_and_rebinds(tiny_config, tiny_weights, tmp_path):
    kc = KernelCache(SimDevice(), tmp_path)
    small, large = build_group("o_ffn", tiny_config, 32), build_group("o_ffn", tiny_config, 64)
    gen = torch.Generator().manual_seed(0)
    attn = torch.randn(64, tiny_config.q_dim, generator=gen).bfloat16()
    x = torch.randn(64, tiny_config.hidden_size, generator=gen).bfloat16()

    def run(g, layer):
        n = g.seq_len
        return kc.load_and_run(g.name, {"attn": attn[:n], "x_res": x[:n]}, f"{g.name}_L{layer}")["out"].clone()

    for g in (small,):
        kc.compile_and_cache(g)
        for layer in (0, 1):
            kc.preload(g.name, f"{g.name}_L{layer}", static_tensors(g, tiny_weights, layer), share_key=f"L{layer}")
    before = [run(small, layer) for layer in (0, 1)]
    kc.compile_and_cache(large)                    # known only now: its buffers are larger
    kc.preload(large.name, f"{large.name}_L0", static_tensors(large, tiny_weights, 0), share_key="L0")
    wide = run(large, 0)
    assert [torch.equal(run(small, layer), b) for layer, b in zip((0, 1), before)] == [True, True]
    assert torch.equal(wide[:32], before[0])        # causal rows: the first 32 are the small bucket's
    assert kc.resident_bytes()["activations"] == sum(
        s.nbytes for s in large.slots if s.role is not Role.STATIC)
    for s in kc._sets.values():
        assert [bo.size for bo in s.bos] == [sl.nbytes for sl in s.group.slots]


def test_a_sub_buffer_moves_only_through_sync_and_only_its_range():
    dev = SimDevice()
    parent = dev.bo(64)
    sub = dev.sub_bo(parent, 16, 8)
    assert sub.size == 16 and dev.counters.bos_allocated == 1 and dev.counters.bytes_allocated == 64
    sub.map().copy_(torch.arange(16, dtype=torch.uint8))
    assert parent.map()[8:24].tolist() == list(range(16))            # one host memory
    assert not parent.device_view(for_write=False)[8:24].any()        # not on the device before a sync
    sub.sync(Sync.TO_DEVICE)
    assert parent.device_view(for_write=False)[8:24].tolist() == list(range(16))
    assert not parent.device_view(for_write=False)[:8].any() and not parent.device_view(for_write=False)[24:].any()
    sub.device_view(for_write=True).fill_(7)
    assert sub.map().tolist() == list(range(16))                      # a kernel's write waits for a sync
    sub.sync(Sync.FROM_DEVICE, 4, offset=2)
    assert sub.map().tolist() == [0, 1, 7, 7, 7, 7] + list(range(6, 16))
    assert dev.counters.bytes_to_device == 16 and dev.counters.bytes_from_device == 4
    assert dev.sub_bo(sub, 4, 4).device_ptr() == parent.device_ptr() + 12  # a sub-buffer of a sub-buffer
    with pytest.raises(DeviceError, match="does not fit"):
        dev.sub_bo(parent, 16, 56)
    with pytest.raises(DeviceError, match="outside"):
        sub.sync(Sync.TO_DEVICE, 8, offset=12)
