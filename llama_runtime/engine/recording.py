"""A decode token as one native program, on a device that declares it can record its runs.

Every layer of a token runs the same calls on the same buffers: `rms_gemv_rope`, the KV row's
store and the attention, `o_gemv_ffn`; then come the final RMSNorm and the LM head's call. On
the simulated device each of those is a few native calls with their pointers fixed, and what
a token still paid was the interpreter between them (writing each input, reading each
output, the layer loop), run from caches the GEMVs had just flushed: several milliseconds of
a Llama-3.2-1B token (docs/profile.md, "Around the calls"). Recorded once, they are one call
per token: the same copies, syncs, kernels and counters, in the same order, so the same
numbers as the call-by-call loop (`decode.decode_layer`, `DeviceModel.logits`). A profiled
run times each recorded op natively and reports the calls as the loop does.

This module is the whole of recording: the device's runs go in through its `api.Recorder`
(`KernelCache.record_run`), the KV store and attention through their native calls
(`KVCache.native_calls`), the final RMSNorm and the head's partitions here; and a program is
kept for as long as its key holds (the recorder's storage epoch, the kernel cache's epoch).
A device without a recorder (the NPU, the interpreter, the torch class, the NPU's numbers)
runs every token call by call, by its declaration. On one that records, a call the program
cannot make is an error (`ReplayError`, naming it), not a token run some other way.
"""
from __future__ import annotations

import torch

from cpu_kernels import native_cpu
from cpu_kernels.native_program import NativeProgram, ReplayError
from llama_runtime.engine.device_model import FINAL_NORM, DeviceModel, bo_key
from llama_runtime.engine.kv_cache import HOST_OP, KVCache
from npu_runtime.api import Recorder, copy_tensor
from npu_runtime.profiler import NULL_PROFILER, Profiler

_PHASES = ("write", "run", "read")


class DecodeProgram:
    def __init__(self, prog: NativeProgram, x_in: torch.Tensor, normed: torch.Tensor, parts: torch.Tensor,
                 positions: int):
        self._prog, self._x_in, self._positions = prog, x_in, positions
        self._normed, self._parts = normed, parts

    @classmethod
    def record(cls, model: DeviceModel, recorder: Recorder, pos: int = 0) -> DecodeProgram:
        """Every layer of `model`'s decode step, the final RMSNorm and the LM head's call,
        recorded through the device's `recorder`; where the model decodes fused, the one call
        of the fused group of `pos`'s window, which serves every position of that window."""
        if model.resident:
            return cls._record_fused(model, recorder, model.fused_group(pos))
        prog = recorder.program()
        cfg, kc, lut = model.config, model.kc, model.rope_lut
        x_in = torch.empty(cfg.hidden_size, dtype=torch.bfloat16)
        x = x_in
        row = lut[0]
        for layer, groups in enumerate(model.decode_groups):
            g1, g2 = groups["rms_gemv_rope"], groups["o_gemv_ffn"]
            qkv = kc.record_run(recorder, prog, g1.name, bo_key(g1, layer),
                                {"x": (x, 0), "rope_lut": (row, row.numel() * row.element_size())})
            attn = _record_store_and_attend(prog, model.kv, layer, qkv, cfg.num_attention_heads)
            x = kc.record_run(recorder, prog, g2.name, bo_key(g2, layer), {"attn": (attn, 0), "x_res": (x, 0)})["out"]
        normed, parts = _record_head(prog, recorder, model, x)
        prog.hold(lut)
        return cls(prog, x_in, normed, parts, min(lut.shape[0], model.kv.max_seq))

    @classmethod
    def _record_fused(cls, model: DeviceModel, recorder: Recorder, g) -> DecodeProgram:
        """The fused group `g`'s call: its position read from a table of positions (the input
        copy steps 4 bytes a token, as the RoPE row steps a row), then the head's partitions
        copied end to end, as `decode._fused_call` concatenates them."""
        prog = recorder.program()
        cfg, kc, lut = model.config, model.kc, model.rope_lut
        x_in = torch.empty(cfg.hidden_size, dtype=torch.bfloat16)
        positions = torch.arange(lut.shape[0], dtype=torch.int32)
        row = lut[0]
        outs = kc.record_run(recorder, prog, g.name, bo_key(g, None),
                             {"x": (x_in, 0), "rope_lut": (row, row.numel() * row.element_size()),
                              "pos": (positions[:1], positions.element_size())})
        views = [outs[name] for name in model.head_parts()]
        parts = _concatenated(prog, views)
        prog.hold(lut, positions, parts)
        return cls(prog, x_in, outs["normed"], parts, min(lut.shape[0], model.kv.max_seq, g.ctx_len))

    @property
    def program(self) -> NativeProgram:
        """The native program itself: its ops by label (`labelled`) say what it covers."""
        return self._prog

    @property
    def row_in(self) -> torch.Tensor:
        """The buffer the first call reads the token's embedding row from: `run(None, pos)` takes
        the row already written there (`DeviceModel.embed_into`)."""
        return self._x_in

    def run(self, x: torch.Tensor | None, pos: int,
            profiler: Profiler = NULL_PROFILER) -> tuple[torch.Tensor, torch.Tensor]:
        """For the token whose embedding row is `x` (None: the one in `row_in`), at `pos`: the
        last layer's row after the final RMSNorm and the LM head's partitions end to end
        (`DeviceModel.head_logits` makes the logits of them), views of buffers valid until the
        next call. An enabled `profiler` gets each group's calls split into write / run / read
        and each host op, as the loop reports them."""
        if not 0 <= pos < self._positions:
            raise IndexError(f"position {pos} is past the KV cache ({self._positions} positions)")
        if x is not None:
            if x.dtype != self._x_in.dtype or x.numel() != self._x_in.numel():
                raise ValueError(f"an embedding row of {x.numel()} {x.dtype} for {self._x_in.numel()} bf16 values")
            copy_tensor(self._x_in, x)
        times = self._prog.run(pos, timed=profiler.enabled)
        if times:
            for (what, name), calls in self._prog.tallies.items():     # labelled by the recorders
                if what == "host":
                    profiler.record_host(name, times.get((what, name), 0.0), calls)
                else:
                    profiler.record_call(name, *(times.get((what, name, phase), 0.0) for phase in _PHASES),
                                         calls=calls)
        return self._normed, self._parts


def _record_store_and_attend(prog: NativeProgram, kv: KVCache, layer: int, qkv: dict[str, torch.Tensor],
                             n_heads: int) -> torch.Tensor:
    """`KVCache.store_and_attend` of `layer` for whatever position the program runs at, its ops
    labelled and tallied as the host op `HOST_OP`, as the loop's profiler times it; returns
    the row the attention writes."""
    q, k_row, v_row = qkv["q"], qkv["k"], qkv["v"]
    native = kv.native_calls(layer, q, k_row, v_row, n_heads)
    if native is None:
        raise ReplayError(f"layer {layer}: the KV store and attention ({HOST_OP}) have no native calls for "
                          f"{q.numel()} query values of {kv.k.shape[-1]}-wide heads")
    calls, out = native
    with prog.host_op(HOST_OP):
        for fn, args, steps in calls:
            prog.call(fn, args, steps)
    prog.hold(kv.k, kv.v, q, k_row, v_row, out)
    return out


def _record_head(prog: NativeProgram, recorder: Recorder, model: DeviceModel,
                 x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `DeviceModel.logits` runs before its host work, recorded after the layers that
    leave their row in `x`: the final RMSNorm (a host op, as the loop times it), the head's
    call on its row, and its partitions copied end to end, as the loop concatenates them."""
    cfg, head = model.config, model.lm_head
    normed = torch.empty(cfg.hidden_size, dtype=torch.bfloat16)
    norm = native_cpu.rmsnorm_call(x, model.final_norm, normed, cfg.hidden_size, cfg.rms_norm_eps)
    if norm is None:
        raise ReplayError(f"{FINAL_NORM}: no native RMSNorm for a {model.final_norm.dtype} weight")
    with prog.host_op(FINAL_NORM):
        prog.bound(norm)
    outs = model.kc.record_run(recorder, prog, head.name, bo_key(head, None), {"x": (normed, 0)})
    parts = _concatenated(prog, [outs[name] for name in model.head_parts()])
    prog.hold(model.final_norm, normed, parts)
    return normed, parts


def _concatenated(prog: NativeProgram, views: list[torch.Tensor]) -> torch.Tensor:
    """A buffer the program fills with `views` end to end, as the loop concatenates them."""
    parts = torch.empty(sum(v.numel() for v in views), dtype=torch.bfloat16)
    at = 0
    for v in views:
        nbytes = v.numel() * v.element_size()
        prog.copy(parts.data_ptr() + at, v.data_ptr(), nbytes)
        at += nbytes
    return parts


def decode_program(model: DeviceModel, pos: int = 0) -> DecodeProgram | None:
    """`model`'s recorded decode token at `pos`, recorded again whenever a buffer it points
    into may have moved (`_key`); None where tokens run call by call: the device declares no
    recorder, or `model.native_decode` is off. A fused model keeps one program per window
    (each window's group is its own call); the card's serves every position."""
    recorder = model.kc.device.recorder() if model.native_decode else None
    if recorder is None:
        return None
    window = model.fused_group(pos).name if model.resident else None
    key = _key(model, recorder)
    kept = model.recorded_decode
    if kept is not None and kept[0] == key and window in kept[1]:
        return kept[1][window]
    program = DecodeProgram.record(model, recorder, pos)
    if _key(model, recorder) != key:
        # The epoch moved while recording (buffers given their first storage): record again,
        # so that the key kept and every address recorded come from one state.
        key = _key(model, recorder)
        program = DecodeProgram.record(model, recorder, pos)
    programs = kept[1] if kept is not None and kept[0] == key else {}
    programs[window] = program
    model.recorded_decode = (key, programs)
    return program


def _key(model: DeviceModel, recorder: Recorder) -> tuple[int, int]:
    """What a recorded program's addresses hold for: no device storage replaced
    (`Recorder.storage_epoch`) and no activation buffer rebound (`KernelCache.epoch`)."""
    return recorder.storage_epoch, model.kc.epoch
