"""The simulated NPU: host and device copies are apart until synced, weights are held packed
out of the host's sight, and every group computes what `reference` says, on each native ISA
class and on the torch bodies."""
from __future__ import annotations

import pytest
import torch

from cpu_kernels import native_cpu, weight_tiles
from kernel_builder.groups import build_group
from llama_base.group_contract import Role
from llama_base.weight_formats import QUANTS
from llama_base import q4nx
from verify import reference as ref
from npu_runtime import api
from npu_runtime.api import DeviceError, Sync
from npu_runtime.devices import open_device
from npu_runtime.sim.device import SimDevice
from npu_runtime.xrt import device as xrt_device
from verify import mlir as verify_mlir


def _program(tiny_config, tmp_path):
    dev = SimDevice()
    g = build_group("o_gemv_ffn", tiny_config)
    dev.compile(g, tmp_path, "")
    return dev, g, dev.load(tmp_path, g)


def _bos(dev, g, weights, kernel=None):
    """The group's BOs with layer 0's weights; allocated for `kernel`'s arguments, the weights are
    held packed on the device, else row-major."""
    bos = [dev.bo(s.nbytes, kernel, i) if kernel else dev.bo(s.nbytes) for i, s in enumerate(g.slots)]
    assert any(b.packing for b in bos) == (kernel is not None and native_cpu.available())
    for i, s in enumerate(g.slots):
        if s.role.value == "static":
            bos[i].write(getattr(weights.layers[0], s.name))
            bos[i].sync(Sync.TO_DEVICE)
    return bos


def _down_weight_rig(tiny_config, tiny_weights, tmp_path, packed):
    """The o_gemv_ffn group on a fixed input, its down-projection weight BO, and a function that
    runs the kernel and returns the output as the host then sees it."""
    dev, g, kernel = _program(tiny_config, tmp_path)
    bos = _bos(dev, g, tiny_weights, kernel if packed else None)
    x, out, w = bos[g.index("x_res")], bos[g.index("out")], bos[g.index("w_down")]
    x.map().view(torch.bfloat16).fill_(0.5)
    x.sync(Sync.TO_DEVICE)

    def result():
        kernel.run(bos)
        out.sync(Sync.FROM_DEVICE)
        return out.map().view(torch.bfloat16).clone()
    return g, x, w, result


LAYOUTS = pytest.mark.parametrize("packed", [False, True], ids=["row-major", "packed"])
ISAS = pytest.mark.usefixtures("native_isa")   # kernels and packing under every ISA class this CPU runs


@ISAS
@LAYOUTS
def test_host_write_without_sync_is_invisible_to_the_kernel(tiny_config, tiny_weights, tmp_path, packed):
    dev, g, kernel = _program(tiny_config, tmp_path)
    bos = _bos(dev, g, tiny_weights, kernel if packed else None)
    out = bos[g.index("out")]
    kernel.run(bos)                                  # all activations zero on the device
    out.sync(Sync.FROM_DEVICE)
    baseline = out.map().clone()
    x = bos[g.index("x_res")]
    x.map().view(torch.bfloat16).fill_(1.0)          # host write, no sync
    kernel.run(bos)
    out.sync(Sync.FROM_DEVICE)
    assert torch.equal(out.map(), baseline)
    x.sync(Sync.TO_DEVICE)
    kernel.run(bos)
    out.sync(Sync.FROM_DEVICE)
    assert not torch.equal(out.map(), baseline)



def test_a_repeated_buffer_list_replays_its_program_without_asking_for_addresses(tiny_config, tiny_weights, tmp_path,
                                                                                 monkeypatch):
    """Decode runs each layer's BO list once a call; while no device storage is replaced the
    bound program is found by the list alone, and a replaced one is looked up again."""
    dev, g, kernel = _program(tiny_config, tmp_path)
    bos = _bos(dev, g, tiny_weights, kernel)
    first = kernel._program(bos)
    asked = []
    for b in bos:
        monkeypatch.setattr(b, "device_ptr", lambda b=b, f=b.device_ptr: asked.append(b) or f())
    assert kernel._program(bos) is first and not asked
    assert kernel._program(list(bos)) is first and len(asked) == len(bos)   # another list: by address
    x = bos[g.index("x_res")]
    x.write(torch.ones(x.size // 2, dtype=torch.bfloat16))
    x.sync(Sync.TO_DEVICE)                      # a whole unmapped write: new device storage
    asked.clear()
    assert kernel._program(bos) is not first and len(asked) == len(bos)

def test_kernel_write_without_sync_is_invisible_to_the_host(tiny_config, tiny_weights, tmp_path):
    dev, g, kernel = _program(tiny_config, tmp_path)
    bos = _bos(dev, g, tiny_weights)
    x = bos[g.index("x_res")]
    x.map().view(torch.bfloat16).fill_(0.5)
    x.sync(Sync.TO_DEVICE)
    kernel.run(bos)
    out = bos[g.index("out")]
    assert int(out.map().count_nonzero()) == 0       # device result not synced back yet
    out.sync(Sync.FROM_DEVICE)
    assert int(out.map().count_nonzero()) > 0


def test_shared_storage_splits_on_host_write():
    """A written-then-synced BO shares storage with the device; a later host write must not leak."""
    dev = SimDevice()
    bo = dev.bo(8)
    bo.write(torch.arange(8, dtype=torch.uint8))
    bo.sync(Sync.TO_DEVICE)
    bo.write(torch.full((8,), 9, dtype=torch.uint8))
    assert torch.equal(bo.device_view(False), torch.arange(8, dtype=torch.uint8))
    bo.sync(Sync.TO_DEVICE)
    assert torch.equal(bo.device_view(False), torch.full((8,), 9, dtype=torch.uint8))


@pytest.mark.parametrize("size", [8, 4 * api._MEMMOVE_MAX])   # a decode row's copy and a prompt's
def test_partial_sync_moves_only_that_range(size):
    dev = SimDevice()
    bo = dev.bo(size)
    q = size // 4
    bo.map().fill_(7)
    bo.sync(Sync.TO_DEVICE, 2 * q, offset=q)
    assert bo.device_view(False).tolist() == [0] * q + [7] * (2 * q) + [0] * q
    assert dev.counters.bytes_to_device == 2 * q
    bo.device_view(True).fill_(5)
    bo.sync(Sync.FROM_DEVICE, q, offset=2 * q)
    assert bo.map().tolist() == [7] * (2 * q) + [5] * q + [7] * q


@pytest.mark.parametrize("nbytes,offset", [(9, 0), (4, 5), (1, -1), (-1, 0)])
def test_a_sync_outside_the_buffer_is_refused(nbytes, offset):
    """Small syncs copy by pointer: a range past the buffer must be an error, not a write
    into whatever memory follows it."""
    bo = SimDevice().bo(8)
    for direction in Sync:
        with pytest.raises(DeviceError, match="outside a 8-byte buffer"):
            bo.sync(direction, nbytes, offset)


@ISAS
@LAYOUTS
def test_a_rewritten_weight_reaches_the_next_run(tiny_config, tiny_weights, tmp_path, packed):
    """A run replays launches bound to its BOs' device memory; a weight written and synced again
    (which gives that BO new device storage) must still be what the next run reads."""
    g, x, w, result = _down_weight_rig(tiny_config, tiny_weights, tmp_path, packed)
    before = result()
    w.write(tiny_weights.layers[0].w_down * 2)
    w.sync(Sync.TO_DEVICE)
    after = result()
    (tmp_path / "fresh").mkdir()
    fresh_dev, _, fresh_kernel = _program(tiny_config, tmp_path / "fresh")
    fresh = _bos(fresh_dev, g, tiny_weights, fresh_kernel if packed else None)
    fresh[g.index("w_down")].write(tiny_weights.layers[0].w_down * 2)
    fresh[g.index("w_down")].sync(Sync.TO_DEVICE)
    fresh[g.index("x_res")].write(x.map())
    fresh[g.index("x_res")].sync(Sync.TO_DEVICE)
    fresh_kernel.run(fresh)
    fresh[g.index("out")].sync(Sync.FROM_DEVICE)
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh[g.index("out")].map().view(torch.bfloat16))


@ISAS
@pytest.mark.skipif(not native_cpu.available(), reason="weights are packed only where the native kernels run")
def test_a_whole_weight_write_packs_from_the_source_and_waits_for_its_sync(tiny_config, tiny_weights, tmp_path):
    """Preload's path: the write packs the caller's tensor without a host copy; the kernel sees
    it only after the sync; a read before the sync still returns what was written."""
    g, x, w, result = _down_weight_rig(tiny_config, tiny_weights, tmp_path, True)
    assert w.packing is not None
    before, w_down = result(), tiny_weights.layers[0].w_down
    w.write(w_down * 2)
    assert w._host is None                               # no host copy of the weight
    assert torch.equal(result(), before)                 # not synced yet
    w.sync(Sync.TO_DEVICE)
    doubled = result()
    assert not torch.equal(doubled, before)
    w.write(w_down * 3)
    assert torch.equal(w.read().view(torch.bfloat16), (w_down * 3).reshape(-1))
    assert torch.equal(result(), doubled)
    w.sync(Sync.TO_DEVICE)                               # the read's host copy is what syncs now
    tripled = result()
    assert not torch.equal(tripled, doubled)
    w.write(w_down * 2)
    w.sync(Sync.TO_DEVICE)
    assert torch.equal(result(), doubled)


def _run(kernel, bos, g, x):
    bos[g.index("x_res")].write(x)
    bos[g.index("x_res")].sync(Sync.TO_DEVICE)
    kernel.run(bos)
    bos[g.index("out")].sync(Sync.FROM_DEVICE)
    return bos[g.index("out")].read().view(torch.bfloat16)


@ISAS
@pytest.mark.skipif(not native_cpu.available(), reason="weights are packed only where the native kernels run")
def test_packed_weights_are_invisible_to_the_host(tiny_config, tiny_weights, tmp_path):
    """The device's packing is its own business: the weight reads back as written, occupies no
    second copy, and a partial sync reaches the device for that range only, as for any BO."""
    dev, g, kernel = _program(tiny_config, tmp_path)
    bos = _bos(dev, g, tiny_weights, kernel)
    i = g.index("w_gate")
    w, bo = tiny_weights.layers[0].w_gate, bos[i]
    assert bo.packing == weight_tiles.Packing(*w.shape) and bo._host is None     # resident once,
    assert bo.device_view(False).numel() < w.numel() * w.element_size()          # in fewer bytes
    assert torch.equal(weight_tiles.from_packed(bo.device_view(False), *w.shape), w)
    assert torch.equal(bo.read().view(torch.bfloat16).view(w.shape), w)

    row = w.shape[1] * 2                                   # bytes per weight row
    host = bo.map().view(torch.bfloat16).view(w.shape)
    host[:3] = 1.0                                         # rows 0-2 written, only 1-2 synced
    bo.sync(Sync.TO_DEVICE, 2 * row, offset=row)
    want = w.clone()
    want[1:3] = 1.0
    assert torch.equal(weight_tiles.from_packed(bo.device_view(False), *w.shape), want)

    # and a kernel on packed weights computes, as on the row-major weights, the reference's numbers
    (tmp_path / "dense").mkdir()
    dense_dev, _, dense_kernel = _program(tiny_config, tmp_path / "dense")
    dense = _bos(dense_dev, g, tiny_weights)
    dense[i].write(want)
    dense[i].sync(Sync.TO_DEVICE)
    x = torch.randn(tiny_config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    data = {**tiny_weights.layers[0].by_name(), "w_gate": want, "x_res": x,
            "attn": torch.zeros(tiny_config.q_dim, dtype=torch.bfloat16)}
    for outputs in (kernel, bos), (dense_kernel, dense):
        ref.assert_group_matches(tiny_config, g, data, {"out": _run(*outputs, g, x)})


def _run_slots(group, data):
    """One run of `group` on a fresh simulated device, weights allocated for their arguments
    (packed, where the native kernels run): every slot a launch stores, as bf16."""
    got = verify_mlir.run_group(SimDevice(), group, "", data, roles=(Role.OUTPUT, Role.INTERMEDIATE))
    return {name: torch.from_numpy(v).bfloat16() for name, v in got.items()}


@pytest.mark.parametrize("quant", QUANTS)
def test_every_group_matches_the_reference(tiny_config, tiny_weights, sim_path, quant):
    """Every group kind and prefill bucket, and attention after cached positions, each slot its
    launches store (outputs and intermediates) against `reference.group_outputs`, to the bound
    `assert_group_matches` states. Q4NX groups run on the tiny weights quantized."""
    cases = verify_mlir.cases(tiny_config, 64, quant)
    assert {c.group.kind for c in cases} == {"rms_gemms_rope", "flash_attn", "o_ffn", "rms_gemv_rope", "o_gemv_ffn",
                                             "lm_head_gemv"} and any(c.q_start for c in cases)
    for case in cases:
        data = verify_mlir.inputs(case, weights=tiny_weights)
        ref.assert_group_matches(tiny_config, case.group, data, _run_slots(case.group, data),
                                 integer_prefill=native_cpu.integer_q4nx_gemm(sim_path),
                                 act_bytes=native_cpu.q4nx_activation_bytes(sim_path))


def test_npu_numerics_hold_every_class_to_the_npus_contract(tiny_config, tiny_weights, sim_path):
    """`SimDevice(npu_numerics=True)`, the side `make verify-mlir` compares the interpreted MLIR
    with: its Q4NX groups meet the NPU's contract (prefill on the dequantized weights, decode's
    activations wide) on every class, including `avx2` and `avx512`, whose own kernels take
    one-byte activations and integer prefill, differences that SmolLM2's real weights push past
    verify-mlir's tolerance."""
    cases = [c for c in verify_mlir.cases(tiny_config, 64, q4nx.NAME) if c.group.quantized]
    assert {c.group.seq_len > 1 for c in cases} == {True, False}
    for case in cases:
        data = verify_mlir.inputs(case, weights=tiny_weights)
        got = verify_mlir.run_group(SimDevice(npu_numerics=True), case.group, "", data,
                                    roles=(Role.OUTPUT, Role.INTERMEDIATE))
        ref.assert_group_matches(tiny_config, case.group, data,
                                 {name: torch.from_numpy(v).bfloat16() for name, v in got.items()})


@ISAS
def test_the_group_check_fails_on_a_norm_that_rounds_once(tiny_config, tiny_weights, monkeypatch):
    """The group bound is tight enough for a rounding missed inside one launch: an RMSNorm that
    multiplies by the weight before rounding (one rounding, not HF's two)."""
    from npu_runtime.sim import ops as sim_ops

    def one_rounding(l, x, w, out):
        xf = x.float().view(-1, l.p("dim"))
        out.view(xf.shape).copy_(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + l.p("eps")) * w.float())

    group = build_group("rms_gemms_rope", tiny_config, 32)
    data = verify_mlir.inputs(verify_mlir.Case(group), weights=tiny_weights)
    ref.assert_group_matches(tiny_config, group, data, _run_slots(group, data))
    monkeypatch.setitem(sim_ops.OPS, "rmsnorm", one_rounding)
    with pytest.raises(AssertionError, match="rms_gemms_rope_s32 normed"):
        ref.assert_group_matches(tiny_config, group, data, _run_slots(group, data))


@ISAS
@pytest.mark.skipif(not native_cpu.available(), reason="weights are packed only where the native kernels run")
def test_a_kernel_may_not_write_a_packed_weight(tiny_config, tiny_weights, tmp_path):
    from npu_runtime.api import DeviceError

    dev, g, kernel = _program(tiny_config, tmp_path)
    bo = next(b for b in _bos(dev, g, tiny_weights, kernel) if b.packing)
    with pytest.raises(DeviceError, match="packed"):
        bo.device_view(for_write=True)


def test_loading_a_program_that_disagrees_with_the_declaration_fails(tiny_config, tmp_path):
    from npu_runtime.api import DeviceError

    dev = SimDevice()
    g = build_group("o_gemv_ffn", tiny_config)
    dev.compile(g, tmp_path, "")
    other = build_group("rms_gemv_rope", tiny_config)
    with pytest.raises(DeviceError, match="does not match"):
        dev.load(tmp_path, other)


def test_auto_device_falls_back_to_the_simulator_and_says_so(capsys):
    found, reason = xrt_device.probe()
    dev = open_device("auto")
    line = capsys.readouterr().out
    if found:
        assert dev.kind == "npu"
    else:
        assert dev.kind == "sim" and reason in line


def test_npu_request_without_npu_is_a_clear_error():
    found, _ = xrt_device.probe()
    if found:
        pytest.skip("an NPU2 is present")
    from llama_base.errors import DeviceUnavailableError, UserError

    with pytest.raises(DeviceUnavailableError, match="DEVICE=npu") as e:
        open_device("npu", verbose=False)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)   # the CLI's one `error:` line


@pytest.mark.npu
def test_xrt_device_round_trip():
    found, reason = xrt_device.probe()
    if not found:
        pytest.skip(f"XRT path not runnable here: {reason}")
    dev = xrt_device.XrtDevice()
    bo = dev.bo(64)
    bo.write(torch.arange(64, dtype=torch.uint8))
    bo.sync(Sync.TO_DEVICE)
    bo.map().zero_()
    bo.sync(Sync.FROM_DEVICE)
    assert bo.map().tolist() == list(range(64))


def test_every_device_implements_the_whole_device_api():
    """The KernelCache calls every member of `api.Device` directly: a device without one would
    fail in the middle of a load, so each device class is checked against the protocol."""
    from npu_runtime.interp.device import InterpDevice

    methods = {n for n, v in vars(api.Device).items() if callable(v) and not n.startswith("_")}
    attributes = set(api.Device.__annotations__)
    assert {"toolchain_description", "load", "compile", "bo"} <= methods and "rebuild_on_load_error" in attributes
    for device in (SimDevice(), InterpDevice()):
        assert [n for n in sorted(methods | attributes) if not hasattr(device, n)] == [], type(device).__name__
    # XrtDevice opens pyxrt when made: its class carries everything but what __init__ sets.
    assert [n for n in sorted(methods | {"kind", "rebuild_on_load_error", "key_on_module_text"})
            if not hasattr(xrt_device.XrtDevice, n)] == []


def test_recording_is_a_capability_each_device_declares():
    """`Device.recorder()` answers for every device: the simulated one records its runs (with the
    native library, on its class's own numbers) and has all of `api.Recorder`; the interpreter
    does not, nor does the NPU (its fake-pyxrt test asks the device itself)."""
    from npu_runtime.interp.device import InterpDevice

    members = {n for n, v in vars(api.Recorder).items() if callable(v) and not n.startswith("_")}
    members |= set(api.Recorder.__annotations__)
    assert members == {"storage_epoch", "program", "record"}
    sim = SimDevice()
    assert sim.recorder() is (sim if native_cpu.available() else None)
    assert all(hasattr(sim, n) for n in members)
    assert SimDevice(npu_numerics=True).recorder() is None and InterpDevice().recorder() is None
    assert xrt_device.XrtDevice.recorder(None) is None
