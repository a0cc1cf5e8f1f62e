"""A decode token as one native program, on a device that can record its runs.

Every layer of a token runs the same calls on the same buffers: `rms_gemv_rope`, the KV row's
store and the attention, `o_gemv_ffn`; then come the final RMSNorm and the LM head's call. On
the simulated device each of those is a few native calls with their pointers fixed, and what
a token still paid was the interpreter between them (writing each input, reading each
output, the layer loop), run from caches the GEMVs had just flushed: several milliseconds of
a Llama-3.2-1B token (docs/profile.md, "Around the calls"). Recorded once
(`KernelCache.record_run`, `KVCache.record_store_and_attend`), they are one call per token:
the same copies, syncs, kernels and counters, in the same order, so the same numbers as the
call-by-call loop (`decode.decode_layer`, `DeviceModel.logits`), which stays the path of the
devices that cannot record (the NPU, the interpreter), of the torch class and of verification
hooks. A profiled run times each recorded op natively and reports the calls as the loop does.
"""
from __future__ import annotations

import torch

from cpu_kernels import native_cpu
from cpu_kernels.native_program import NativeProgram
from llama_runtime.engine.device_model import FINAL_NORM, DeviceModel, bo_key
from npu_runtime.api import copy_tensor
from npu_runtime.profiler import NULL_PROFILER, Profiler

_PHASES = ("write", "run", "read")


class DecodeProgram:
    def __init__(self, prog: NativeProgram, x_in: torch.Tensor, normed: torch.Tensor, parts: torch.Tensor,
                 positions: int):
        self._prog, self._x_in, self._positions = prog, x_in, positions
        self._normed, self._parts = normed, parts

    @classmethod
    def record(cls, model: DeviceModel) -> DecodeProgram | None:
        """Every layer of `model`'s decode step, the final RMSNorm and the LM head's call,
        recorded; None where some part of it cannot be."""
        prog = NativeProgram.new()
        if prog is None:
            return None
        cfg, kc, lut = model.config, model.kc, model.rope_lut
        x_in = torch.empty(cfg.hidden_size, dtype=torch.bfloat16)
        x = x_in
        row = lut[0]
        for layer, groups in enumerate(model.decode_groups):
            g1, g2 = groups["rms_gemv_rope"], groups["o_gemv_ffn"]
            qkv = kc.record_run(prog, g1.name, bo_key(g1, layer),
                                {"x": (x, 0), "rope_lut": (row, row.numel() * row.element_size())})
            if qkv is None:
                return None
            attn = model.kv.record_store_and_attend(prog, layer, qkv["q"], qkv["k"], qkv["v"],
                                                    cfg.num_attention_heads)
            if attn is None:
                return None
            out = kc.record_run(prog, g2.name, bo_key(g2, layer), {"attn": (attn, 0), "x_res": (x, 0)})
            if out is None:
                return None
            x = out["out"]
        head = _record_head(prog, model, x)
        if head is None:
            return None
        prog.hold(lut)
        return cls(prog, x_in, *head, min(lut.shape[0], model.kv.max_seq))

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


def _record_head(prog: NativeProgram, model: DeviceModel,
                 x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What `DeviceModel.logits` runs before its host work, recorded after the layers that
    leave their row in `x`: the final RMSNorm (a host op, as the loop times it), the head's
    call on its row, and its partitions copied end to end, as the loop concatenates them."""
    cfg, head = model.config, model.lm_head
    normed = torch.empty(cfg.hidden_size, dtype=torch.bfloat16)
    norm = native_cpu.rmsnorm_call(x, model.final_norm, normed, cfg.hidden_size, cfg.rms_norm_eps)
    if norm is None:
        return None
    with prog.host_op(FINAL_NORM):
        if not prog.bound(norm):
            return None
    outs = model.kc.record_run(prog, head.name, bo_key(head, None), {"x": (normed, 0)})
    if outs is None:
        return None
    views = [outs[name] for name in model.head_parts()]
    parts = torch.empty(sum(v.numel() for v in views), dtype=torch.bfloat16)
    at = 0
    for v in views:
        nbytes = v.numel() * v.element_size()
        prog.copy(parts.data_ptr() + at, v.data_ptr(), nbytes)
        at += nbytes
    prog.hold(model.final_norm, normed, parts)
    return normed, parts


def decode_program(model: DeviceModel) -> DecodeProgram | None:
    """`model`'s recorded decode layers, recorded again whenever a buffer they point into may
    have moved (the device's storage epoch, the kernel cache's); None where they cannot be
    recorded or `model.native_decode` is off."""
    if not model.native_decode:
        return None
    key = _storage_key(model)
    if model.recorded_decode is not None and model.recorded_decode[0] == key:
        return model.recorded_decode[1]
    program = DecodeProgram.record(model)
    if _storage_key(model) != key:
        # The epoch moved while recording (buffers given their first storage): record again,
        # so that the key kept and every address recorded come from one state.
        key = _storage_key(model)
        program = DecodeProgram.record(model)
    model.recorded_decode = (key, program)
    return program


def _storage_key(model: DeviceModel) -> tuple:
    return getattr(model.kc.device, "storage_epoch", None), model.kc.epoch
