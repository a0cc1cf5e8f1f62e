"""Decode's layers recorded as one native program (`llama_runtime.engine.recording`) against the
call-by-call loop they replace: the same logits to the bit, the same KV cache, the same device
counters and the same profile, under every ISA class this CPU runs and in both weight formats;
every call of a token in the program; recorded again when a buffer moves under it; never run
past the cache. Devices that declare no recorder keep the loop; on one that records, a call the
program cannot make raises, named. And the recorder itself (`cpu_kernels.native_program`):
position steps, float arguments, the functions and signatures it refuses, and the one
declaration those signatures come from."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cpu_kernels import native_cpu
from cpu_kernels.native_program import NativeProgram, ReplayError, signature
from llama_base.errors import PromptError
from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.recording import decode_program
from llama_runtime.engine.device_model import FINAL_NORM, DeviceModel, bo_key
from llama_runtime.engine.kv_cache import HOST_OP
from llama_runtime.engine.prefill import prefill
from llama_runtime.generation.session import build_session
from npu_runtime.api import Sync
from npu_runtime.cache import KernelCache
from npu_runtime.profiler import Profiler
from npu_runtime.sim import ops
from npu_runtime.sim.device import SimDevice, SimKernel

native = pytest.mark.skipif(native_cpu._library() is None,
                            reason="no C++ compiler or no AVX2 on this CPU: nothing to record")


@pytest.fixture(scope="module")
def q4nx_session(tmp_path_factory):
    return build_session("embedded", "sim", max_context=256, cache_dir=tmp_path_factory.mktemp("kernels"), decode="layers",
                         buckets=(64,), log=lambda s: None, quant="q4nx")


def _tiny(tmp_path, weights) -> DeviceModel:
    return DeviceModel(KernelCache(SimDevice(), tmp_path), weights, 256, buckets=(128,))


def _steps(model: DeviceModel, native: bool, tokens: list[int], start: int):
    """Decode steps feeding `tokens` from position `start`: each step's logits, and the change
    of the device's counters of bytes synced each way and of runs."""
    model.native_decode = native
    c = model.kc.device.counters
    before = (c.bytes_to_device, c.bytes_from_device, c.runs)
    out = [decode_step(model, t, start + i).clone() for i, t in enumerate(tokens)]
    return out, [a - b for a, b in zip((c.bytes_to_device, c.bytes_from_device, c.runs), before)]


def _both_ways(model: DeviceModel, prompt: list[int], tokens: list[int], monkeypatch) -> None:
    """The loop, then the program from the same cache state: every result equal, and the
    program's token (its layers and the LM head) ran no device call from Python."""
    prefill(model, prompt)
    k, v, held = model.kv.k.clone(), model.kv.v.clone(), list(model.kv.token_ids)
    loop, loop_counts = _steps(model, False, tokens, len(prompt))
    loop_k, loop_v = model.kv.k.clone(), model.kv.v.clone()
    model.kv.k.copy_(k), model.kv.v.copy_(v)
    model.kv.token_ids[:] = held
    runs = []
    real = SimKernel.run
    monkeypatch.setattr(SimKernel, "run", lambda self, bos: runs.append(self.group.kind) or real(self, bos))
    ours, counts = _steps(model, True, tokens, len(prompt))
    assert decode_program(model) is not None
    assert runs == []                                     # the whole token ran inside the program
    assert all(torch.equal(a, b) for a, b in zip(loop, ours))
    assert torch.equal(model.kv.k, loop_k) and torch.equal(model.kv.v, loop_v)
    assert counts == loop_counts and counts[2] == len(tokens) * (2 * model.config.num_hidden_layers + 1)
    assert model.kv.token_ids == held + tokens


@native
@pytest.mark.usefixtures("native_isa")
def test_the_recorded_layers_are_the_loop_bit_for_bit_bf16(tiny_weights, tmp_path, monkeypatch):
    """bf16 weights, every class: positions 124..131 cross the attention kernel's 128-position
    split, so the attention's length steps through it."""
    _both_ways(_tiny(tmp_path, tiny_weights), list(range(3, 127)), [5, 9, 200, 7, 7, 31, 4, 100], monkeypatch)


@native
def test_the_recorded_layers_are_the_loop_bit_for_bit_q4nx(q4nx_session, monkeypatch):
    """Q4NX weights (the embedded model's fused 4-bit GEMVs), the head rescored after them."""
    model = q4nx_session.model
    _both_ways(model, q4nx_session.encode("The capital of France is"), [330, 2, 4000, 17, 9], monkeypatch)


@native
def test_a_recorded_step_reads_its_embedding_row_from_the_file_into_its_first_calls_input(q4nx_session,
                                                                                          monkeypatch):
    """Where the table is read from its file, a recorded step's row goes straight into the buffer
    its first call reads, with no tensor on the way, and the token's logits are those of the row
    handed over as a tensor; a token outside the vocabulary is refused before the cache is touched."""
    model = q4nx_session.model
    model.native_decode = True
    prompt = q4nx_session.encode("The capital of France is")
    prefill(model, prompt)
    pos = len(prompt)
    k, v, held = model.kv.k.clone(), model.kv.v.clone(), list(model.kv.token_ids)
    program = decode_program(model)
    normed, parts = program.run(model.embed_tokens([330])[0], pos)
    handed = model.head_logits(parts, normed)
    model.kv.k.copy_(k), model.kv.v.copy_(v)
    model.kv.token_ids[:] = held
    monkeypatch.setattr(model, "embed_tokens", lambda ids: pytest.fail("the row went through a tensor"))
    assert torch.equal(decode_step(model, 330, pos), handed)
    assert torch.equal(program.row_in, model.embed[330])
    with pytest.raises(PromptError, match="outside the model's vocabulary"):
        decode_step(model, model.config.vocab_size, pos + 1)
    assert model.kv.token_ids == held + [330]


@native
def test_a_weight_rewritten_after_recording_is_the_one_the_next_token_reads(tiny_weights, tmp_path):
    """A weight written and synced again moves to new device storage; the program recorded on
    the old one must not be replayed (it would read freed memory): it is recorded again, and the
    token reads the new weight, as the loop does."""
    model = _tiny(tmp_path, tiny_weights)
    prefill(model, list(range(3, 20)))
    k, v = model.kv.k.clone(), model.kv.v.clone()
    before = decode_step(model, 5, 17).clone()
    first = decode_program(model)
    g2 = model.decode_groups[1]["o_gemv_ffn"]
    s = model.kc._sets[bo_key(g2, 1)]
    i = next(i for i, sl in enumerate(g2.slots) if sl.name == "w_down")
    s.bos[i].write(torch.randn(g2.slots[i].storage_shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
    s.bos[i].sync(Sync.TO_DEVICE)

    def step(native: bool) -> torch.Tensor:
        model.kv.k.copy_(k), model.kv.v.copy_(v)
        model.native_decode = native
        return decode_step(model, 5, 17).clone()

    ours = step(True)
    assert decode_program(model) is not first
    assert torch.equal(ours, step(False)) and not torch.equal(ours, before)


@native
def test_a_profiled_token_reports_the_calls_the_loop_reports(tiny_weights, tmp_path):
    """`make profile` and the bench's host share time the program op by op: the same groups and
    host ops with the same call counts as the loop, their writes, runs and reads apart."""
    model = _tiny(tmp_path, tiny_weights)
    prefill(model, list(range(3, 20)))
    seen = {}
    for native in (False, True):
        model.profiler = model.kc.profiler = prof = Profiler()
        model.native_decode = native
        for pos in (17, 18, 19):
            decode_step(model, 5, pos)
        seen[native] = ({g: s.calls for g, s in prof.groups.items()}, {h: s.calls for h, s in prof.host.items()})
        assert all(s.run_s > 0 for s in prof.groups.values()) and all(s.run_s > 0 for s in prof.host.values())
    assert seen[True] == seen[False]
    assert seen[True][0]["o_gemv_ffn"] == 3 * model.config.num_hidden_layers
    assert seen[True][0]["lm_head_gemv"] == 3 and seen[True][1][FINAL_NORM] == 3
    assert prof.groups["rms_gemv_rope"].write_s > 0 and prof.groups["rms_gemv_rope"].read_s > 0


@native
def test_the_program_never_runs_past_the_cache(tiny_weights, tmp_path):
    model = _tiny(tmp_path, tiny_weights)
    prefill(model, list(range(3, 20)))
    decode_step(model, 5, 17)
    program, k = decode_program(model), model.kv.k.clone()
    for pos in (model.kv.max_seq, -1):
        with pytest.raises(IndexError, match="past the KV cache"):
            program.run(model.embed_tokens([5])[0], pos)
    assert torch.equal(model.kv.k, k)


def test_devices_that_cannot_record_keep_the_loop_by_declaration(tiny_weights, tmp_path, monkeypatch):
    """Without the native library (the torch class), and on the NPU's numbers, the simulated
    device declares no recorder: a token runs call by call, and no recording is even tried."""
    monkeypatch.setattr(SimDevice, "program", lambda self: pytest.fail("a recording was tried"))
    with native_cpu.use_isa(native_cpu.TORCH):
        model = _tiny(tmp_path / "torch", tiny_weights)
        prefill(model, list(range(3, 20)))
        decode_step(model, 5, 17)
        assert model.kc.device.recorder() is None
        assert decode_program(model) is None and model.recorded_decode is None
    device = SimDevice(npu_numerics=True)
    model = DeviceModel(KernelCache(device, tmp_path / "npu"), tiny_weights, 256, buckets=(128,))
    prefill(model, list(range(3, 20)))
    decode_step(model, 5, 17)
    assert model.kc.device.recorder() is None and model.recorded_decode is None


@native
@pytest.mark.parametrize("quant", ["bf16", "q4nx"])
def test_the_program_holds_every_call_of_a_token(quant, tiny_weights, q4nx_session, tmp_path, monkeypatch):
    """Every kernel a decode token runs binds into the program: each layer's two groups and the
    head, each with as many native calls as the device's run of it makes (counted on the
    loop), and each layer's KV store and attention, the final RMSNorm."""
    model = _tiny(tmp_path, tiny_weights) if quant == "bf16" else q4nx_session.model
    prefill(model, list(range(3, 20)))
    calls: dict[str, int] = {}
    real = SimKernel.run

    def counted(self, bos):
        calls[self.group.kind] = calls.get(self.group.kind, 0) + len(self._program(bos))
        real(self, bos)

    monkeypatch.setattr(SimKernel, "run", counted)
    model.native_decode = False
    decode_step(model, 5, 17)
    model.native_decode = True
    prog = decode_program(model).program
    layers, ops_of = model.config.num_hidden_layers, prog.labelled()
    assert {kind: ops_of[("call", kind, "run")] for kind in calls} == calls
    assert set(calls) == {"rms_gemv_rope", "o_gemv_ffn", "lm_head_gemv"}
    assert prog.tallies == {("call", "rms_gemv_rope"): layers, ("host", HOST_OP): layers,
                            ("call", "o_gemv_ffn"): layers, ("host", FINAL_NORM): 1, ("call", "lm_head_gemv"): 1}
    assert ops_of[("host", HOST_OP)] == 2 * layers and ops_of[("host", FINAL_NORM)] == 1


@native
def test_a_launch_the_program_cannot_replay_fails_the_recording_by_name(tiny_weights, tmp_path, monkeypatch):
    """On a device that records, a launch bound to a torch body (here SwiGLU, replaced by a
    Python function) or a host op with no native calls is an error naming it, not a token run
    some other way; the loop still runs both."""
    monkeypatch.setitem(ops.OPS, "swiglu", lambda launch, *views: ops.swiglu(launch, *views))
    model = _tiny(tmp_path / "swiglu", tiny_weights)
    prefill(model, list(range(3, 20)))
    with pytest.raises(ReplayError, match=r"o_gemv_ffn.*, launch \w+ \(swiglu\): <lambda>: not a native call"):
        decode_step(model, 5, 17)
    model.native_decode = False
    decode_step(model, 5, 17)
    monkeypatch.undo()
    monkeypatch.setattr(native_cpu, "decode_step_calls", lambda *a: None)
    model = _tiny(tmp_path / "kv", tiny_weights)
    prefill(model, list(range(3, 20)))
    kv_op = re.escape(HOST_OP)
    with pytest.raises(ReplayError, match=rf"layer 0: the KV store and attention \({kv_op}\) have no native calls"):
        decode_step(model, 5, 17)
    model.native_decode = False
    decode_step(model, 5, 17)


@native
def test_a_native_program_steps_its_arguments_with_the_position():
    """A copy from a table row that follows the position; a recorded call with a float argument
    (RMSNorm's epsilon) equal to the call made directly; a function the replay does not know,
    the wrong arguments for one it knows and a body that is no native call are refused, each
    named with its signature."""
    prog = NativeProgram.new()
    table = torch.arange(40, dtype=torch.bfloat16).view(10, 4)
    row = torch.zeros(4, dtype=torch.bfloat16)
    prog.copy(row.data_ptr(), table.data_ptr(), 8, src_step=8)
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.randn(64).to(torch.bfloat16)
    out, want = torch.empty_like(x), torch.empty_like(x)
    prog.bound(native_cpu.rmsnorm_call(x, w, out, 64, 0.25))
    prog.hold(table, row, x, w, out)
    for pos in (0, 7, 3):
        prog.run(pos)
        assert torch.equal(row, table[pos])
    assert native_cpu.rmsnorm(x, w, want, 64, 0.25) and torch.equal(out, want)
    assert native_cpu.rmsnorm(x, w, want, 64, 1e-5) and not torch.equal(want, out)   # the epsilon arrived

    lib = native_cpu._library()
    with pytest.raises(ReplayError, match=r"^top_k_ids_cpu\(pqqp\): not a function the native program replays"):
        prog.call(lib.top_k_ids_cpu, (1, 2, 3, 4))
    with pytest.raises(ReplayError, match=r"^rmsnorm_bf16_cpu\(pppqqf\): 2 arguments"):
        prog.call(lib.rmsnorm_bf16_cpu, (1, 2))
    with pytest.raises(ReplayError, match=r"^rmsnorm_bf16_cpu\(pppqqf\): argument 5 is a str"):
        prog.call(lib.rmsnorm_bf16_cpu, (1, 2, 3, 4, 5, "eps"))
    with pytest.raises(ReplayError, match="^<lambda>: not a native call"):
        prog.bound(lambda: None)
    assert len(prog) == 2


@native
def test_a_pool_replaced_by_a_longer_context_is_recorded_again(tiny_weights, tmp_path):
    """A prompt continued past its bucket's context compiles attention for a longer one, whose
    larger buffers replace the shared ones (`KernelCache.epoch`): the next token records again
    and still reads what the loop reads."""
    model = DeviceModel(KernelCache(SimDevice(), tmp_path), tiny_weights, 256, buckets=(32,))
    prompt = list(range(3, 23))
    prefill(model, prompt)
    decode_step(model, 5, 20)
    first, epoch = decode_program(model), model.kc.epoch
    prefill(model, list(range(40, 70)), start=21)            # positions 21..50: a 64-position context
    assert model.kc.epoch > epoch
    k, v = model.kv.k.clone(), model.kv.v.clone()
    ours = decode_step(model, 9, 51).clone()
    assert decode_program(model) is not first
    model.kv.k.copy_(k), model.kv.v.copy_(v)
    model.native_decode = False
    assert torch.equal(ours, decode_step(model, 9, 51))


@native
def test_the_replayed_functions_argtypes_are_the_librarys_table():
    """Every function the program replays has the ctypes argtypes its prototype gives
    (native/replayed.h, read from the library's table), and those include every kernel a
    decode layer binds; a function whose argtypes are not the table's is refused."""
    lib = native_cpu._library()
    assert lib.replayed and all(signature(getattr(lib, name)) == kinds for name, (_, kinds) in lib.replayed.items())
    assert lib.replayed["rmsnorm_bf16_cpu"][1] == "pppqqf" and lib.replayed["gemv_packed_bf16_cpu_batch"][1] == "pi"
    twin = lib["rmsnorm_bf16_cpu"]                  # a second handle of it, argtypes of its own
    twin.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3      # eps declared an int64
    prog = NativeProgram.new()
    with pytest.raises(ReplayError, match=r"rmsnorm_bf16_cpu: its argtypes say \(pppqqq\), the library's table "
                                          r"\(pppqqf\)"):
        prog.call(twin, (1, 2, 3, 1, 64, 0))
    assert len(prog) == 0


class _Entry:
    """A stand-in for one of the library's table functions: code -> bytes, "" past the last."""

    def __init__(self, rows: list[str]):
        self.rows, self.argtypes, self.restype = rows, None, None

    def __call__(self, code: int) -> bytes:
        return (self.rows[code] if code < len(self.rows) else "").encode()


def test_a_library_whose_table_holds_an_unknown_kind_is_refused_at_load():
    """Python passes the kinds of `native_cpu.ARG_TYPES`; a table with another one (a double)
    is a library from other sources, refused when it loads rather than miscalled."""
    class Lib:
        native_program_function = _Entry(["native_program_copy", "scale_f64"])
        native_program_signature = _Entry(["ppq", "ppd"])

    with pytest.raises(RuntimeError, match=r"scale_f64\(ppd\) takes argument kinds \['d'\]"):
        native_cpu.replayed_functions(Lib())
    Lib.native_program_signature = _Entry(["ppq", "ppf"])
    assert native_cpu.replayed_functions(Lib()) == {"native_program_copy": (0, "ppq"), "scale_f64": (1, "ppf")}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_a_kernel_defined_apart_from_its_replayed_prototype_does_not_compile(tmp_path):
    """The replay derives each function's call from its prototype; the kernel's source includes
    the same prototypes, so a definition that takes other types fails its build."""
    native = Path(native_cpu.__file__).parent / "native"

    def compiles(params: str) -> bool:
        src = tmp_path / "kernel.cc"
        src.write_text(f'#include "replayed.h"\nextern "C" void add_bf16_cpu({params}) {{}}\n')
        return subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{native}", str(src)],
                              capture_output=True).returncode == 0

    assert compiles("const uint16_t *a, const uint16_t *b, uint16_t *out, int64_t n")
    assert not compiles("const uint16_t *a, const uint16_t *b, uint16_t *out, int n")
