"""KernelCache: a group's buffer sets, uploaded once, and its runs, over an `ArtifactCache`.

BOs: a *BO set* (`bo_key`, per layer: f"{group}_L{layer}") holds a group's static slots.
Statics are written once by `preload`; with a `share_key` (the layer) the prefill and decode
groups of a layer use one BO per weight, so weights are resident once. Input, intermediate
and output slots are activations, and because calls are sequential their memory is shared
(`activation_pool`): every layer's set of a group uses the same BOs, the groups of one kind
(the prefill buckets, attention at each context) share one buffer per slot sized for the
largest of them, and every group's intermediates share one set of scratch buffers. A group
whose slot is smaller than its pool's buffer gets a sub-buffer of it (`Device.sub_bo`), so a
kernel's BO is always the size its argument declares. On every call the host writes only
`input` slots and reads back only `output` slots; it never touches `static` slots after
preload or `intermediate` ones. All of those sets come from the group declaration.

The compiled artifacts, their disk cache and the loaded kernels are the `ArtifactCache`'s
(`artifacts`); this class only asks it for a group's kernel.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llama_base.group_contract import KernelGroup, Role, split_layer_slot
from llama_base.errors import KernelCacheError
from npu_runtime.api import BO, Device, RecordedInput, RecordedOutput, Recorder, Sync, copy_tensor
from npu_runtime.artifacts import ArtifactCache, CacheStats
from npu_runtime.profiler import NULL_PROFILER, Profiler

if TYPE_CHECKING:
    from cpu_kernels.native_program import NativeProgram


@dataclass
class BOSet:
    group: KernelGroup
    bos: list
    statics_ready: bool = False
    calls: int = 0
    # slot index -> typed view of that activation BO's whole mapped memory. A BO maps the same
    # memory for its whole life, and rebuilding the view on every call is a handful of tensor
    # ops, which in decode cost more than copying the row itself.
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    io: tuple = ((), ())    # `KernelCache._io(set, None)`, set with the activations
    share_key: str | None = None   # preload's: whose weights and state the set shares


class KernelCache:
    def __init__(self, device: Device, cache_dir: Path | None = None, profiler: Profiler | None = None,
                 max_loaded: int | None = None, lock_timeout: float = 600.0, allow_compile: bool = True,
                 refresh_toolchain: bool = False):
        self.device = device
        self.artifacts = ArtifactCache(device, cache_dir, max_loaded, lock_timeout, allow_compile, refresh_toolchain)
        self.profiler = profiler or NULL_PROFILER
        self._sets: dict[str, BOSet] = {}
        self._statics: dict[tuple[str, str], BO] = {}
        self._pools: dict[tuple[str, str], BO] = {}     # activation_pool -> the buffer it owns
        self._states: dict[tuple[str, str], BO] = {}    # `shared_slot` -> a resident state buffer
        self._acts: dict[tuple[str, str], BO] = {}      # (group, slot) -> its BO: a pool's, or a sub-buffer of it
        self._pool_names: dict[str, dict[str, tuple[str, str]]] = {}
        self.epoch = 0      # bumped whenever a set's activation BOs are replaced (`record_run`'s users look)

    @property
    def stats(self) -> CacheStats:
        return self.artifacts.stats

    @property
    def dir(self) -> Path:
        return self.artifacts.dir

    def compile_and_cache(self, group: KernelGroup) -> Path:
        """The group's artifact, built unless a valid one is on disk; its BO sets can then be made."""
        return self.artifacts.compile_and_cache(group)

    def _bo_set(self, name: str, bo_key: str) -> BOSet:
        s = self._sets.get(bo_key)
        if s is not None:
            if s.group.name != name:
                raise KeyError(f"bo_key {bo_key!r} belongs to {s.group.name}, not {name}")
            return s
        group = self.artifacts.group(name)
        # Statics are filled by preload, activations on the set's first run (`_activation`).
        s = self._sets[bo_key] = BOSet(group, [None] * len(group.slots))
        return s

    def _bind_activations(self, s: BOSet) -> None:
        for i, slot in enumerate(s.group.slots):
            if slot.role is Role.STATE and s.bos[i] is None:
                s.bos[i] = self._state(s, slot)
            elif slot.role is not Role.STATIC and s.bos[i] is None:
                s.bos[i] = self._activation(s.group, slot)
        s.io = self._io(s, None)

    def _state(self, s: BOSet, slot) -> BO:
        """The resident buffer of a state slot: one per (layer, name) for every group that
        names it (prefill's attention appends to the KV cache decode reads), allocated zeroed
        on first use and never written by the host."""
        key = shared_slot(slot.name, s.share_key)
        bo = self._states.get(key)
        if bo is None:
            bo = self._states[key] = self.device.bo(slot.nbytes)
        elif bo.size != slot.nbytes:
            raise KernelCacheError(f"{s.group.name}.{slot.name}: a state buffer of {bo.size} bytes exists for "
                                   f"{key[0]}.{key[1]}, this group declares {slot.nbytes}")
        return bo

    def _activation(self, group: KernelGroup, slot) -> BO:
        """The BO of one of `group`'s activation slots: its pool's buffer when that is the slot's
        size, else a sub-buffer of it. A pool's buffer is sized for the largest slot of every
        group compiled so far; a group compiled later that needs more (attention over a longer
        context) replaces it with a larger one, and the sets bound to the old one are rebound."""
        key = (group.name, slot.name)
        bo = self._acts.get(key)
        if bo is not None:
            return bo
        pool = self._pool_of(group)[slot.name]
        buf = self._pools.get(pool)
        if buf is None or buf.size < slot.nbytes:
            need = max([slot.nbytes] + [g.slot(name).nbytes for g in self.artifacts.groups()
                                        for name, p in self._pool_of(g).items() if p == pool])
            buf = self._replace_pool(pool, need)
        bo = self._acts[key] = self._slot_bo(buf, slot.nbytes)
        return bo

    def _slot_bo(self, buf: BO, nbytes: int) -> BO:
        """A pool's buffer as a slot of `nbytes` sees it: the buffer itself, or a sub-buffer."""
        return buf if buf.size == nbytes else self.device.sub_bo(buf, nbytes)

    def _pool_of(self, group: KernelGroup) -> dict[str, tuple[str, str]]:
        """Slot name -> `activation_pool`, for each activation slot of the group (kept per group)."""
        pools = self._pool_names.get(group.name)
        if pools is None:
            pools = self._pool_names[group.name] = {sl.name: activation_pool(group, sl) for sl in group.slots
                                                    if sl.role not in (Role.STATIC, Role.STATE)}
        return pools

    def _replace_pool(self, pool: tuple[str, str], nbytes: int) -> BO:
        old = self._pools.get(pool)
        buf = self._pools[pool] = self.device.bo(nbytes)
        if old is None:
            return buf
        self.epoch += 1
        moved: dict[int, tuple[BO, BO]] = {}     # id of the old BO -> (old, new); old kept alive meanwhile
        for key, bo in list(self._acts.items()):
            group = self.artifacts.group(key[0])
            slot = group.slot(key[1])
            if self._pool_of(group)[slot.name] == pool:
                new = self._acts[key] = self._slot_bo(buf, slot.nbytes)
                moved[id(bo)] = (bo, new)
        for s in self._sets.values():
            if any(b is not None and id(b) in moved for b in s.bos):
                s.bos = [moved[id(b)][1] if b is not None and id(b) in moved else b for b in s.bos]
                s.views.clear()
                s.io = self._io(s, None)
        return buf

    def preload(self, name: str, bo_key: str, statics: dict[str, torch.Tensor], share_key: str | None = None) -> None:
        """Upload a BO set's static slots once. With `share_key`, reuse another group's identical weight BO."""
        s = self._bo_set(name, bo_key)
        s.share_key = share_key or bo_key
        for i, slot in enumerate(s.group.slots):
            if slot.role is not Role.STATIC or s.bos[i] is not None:
                continue
            pool_key = shared_slot(slot.name, s.share_key)
            bo = self._statics.get(pool_key)
            if bo is None or bo.size != slot.nbytes:
                t = statics[slot.name]
                if tuple(t.shape) != slot.storage_shape or t.dtype != slot.torch_dtype:
                    raise ValueError(f"{name}.{slot.name}: got {tuple(t.shape)} {t.dtype}, "
                                     f"declared {slot.shape} {slot.dtype}")
                bo = self.device.bo(slot.nbytes, self.artifacts.kernel(name), i)
                bo.write(t)
                bo.sync(Sync.TO_DEVICE)
                self._statics[pool_key] = bo
            s.bos[i] = bo
        s.statics_ready = True

    # ---- running ------------------------------------------------------------------------
    def load_and_run(self, name: str, inputs: dict[str, torch.Tensor], bo_key: str,
                     rows: int | None = None, context: int | None = None) -> dict[str, torch.Tensor]:
        """Write the inputs, run, read back the outputs (views valid until the next call of a
        group of the same kind: the buckets of a kind share their buffers).

        `rows` limits the host's writes and reads to the first rows of row-major activations
        (a prompt shorter than its bucket): rows past it are padding that, by causality,
        never influences the real ones. `context` limits the writes of KV-cache slots
        (`Slot.cache_positions`) to their first positions, those written so far; their inputs
        are given that long. The cache's positions past them were never written, and reading
        them would map the kernel's shared zero page there: each later write of a token's K/V
        would then replace that mapping, which flushes every core's TLB (about 20 µs a page on
        a 2-core VM against 1.5 for a first write, a 5 ms decode step one in 32).
        """
        kernel = self.artifacts.kernel(name)
        s = self._runnable_set(name, bo_key)
        prof = self.profiler.enabled
        t0 = time.perf_counter() if prof else 0.0
        ins, outs = s.io if rows is None and context is None else self._io(s, rows, context)
        for slot, view, bo, nbytes in ins:
            t = inputs[slot.name]
            if t.numel() != view.numel():
                raise ValueError(f"{name}.{slot.name}: {t.numel()} elements where {view.numel()} of {slot.shape} "
                                 "are written")
            if t.dtype == view.dtype and t.is_contiguous() and view.is_contiguous():
                copy_tensor(view, t)
            else:
                view.copy_(t.reshape(view.shape))
            if view.is_contiguous():
                bo.sync(Sync.TO_DEVICE, nbytes)
            else:   # a KV-cache slot's first positions (`_cache_io`): each head's own bytes
                pitch = view.stride(0) * view.element_size()
                for head in range(view.shape[0]):
                    bo.sync(Sync.TO_DEVICE, nbytes, head * pitch)
        t1 = time.perf_counter() if prof else 0.0
        kernel.run(s.bos)
        t2 = time.perf_counter() if prof else 0.0
        out = {}
        for slot, view, bo, nbytes in outs:
            bo.sync(Sync.FROM_DEVICE, nbytes)
            out[slot.name] = view
        s.calls += 1
        if prof:
            self.profiler.record_call(s.group.kind, t1 - t0, t2 - t1, time.perf_counter() - t2)
        return out

    def record_run(self, recorder: Recorder, prog: NativeProgram, name: str, bo_key: str,
                   sources: dict[str, tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
        """Append `load_and_run(name, ..., bo_key)` to a native program through the device's
        `recorder` (`api.Recorder`), each input slot read from `sources[slot]` = (tensor, step):
        the tensor's bytes at position 0, `step` bytes further on per position (a table row);
        the caller keeps the positions it runs at inside the tensor's storage. Returns the
        output views the program fills. The program stays valid while neither the recorder's
        `storage_epoch` nor this cache's `epoch` changes."""
        kernel = self.artifacts.kernel(name)
        s = self._runnable_set(name, bo_key)
        ins, outs = s.io
        inputs = []
        for slot, _, bo, n in ins:
            t, step = sources[slot.name]
            if not t.is_contiguous() or t.numel() * t.element_size() != n:
                raise ValueError(f"{name}.{slot.name}: a source of {t.numel() * t.element_size()} bytes "
                                 f"for a {n}-byte input")
            inputs.append(RecordedInput(bo, n, t.data_ptr(), step))
            prog.hold(t)
        recorder.record(prog, kernel, s.bos, inputs, [RecordedOutput(bo, n) for _, _, bo, n in outs])
        return {slot.name: view for slot, view, _, _ in outs}

    def _runnable_set(self, name: str, bo_key: str) -> BOSet:
        """A BO set ready for a run (or its recording): statics uploaded, activations bound."""
        s = self._bo_set(name, bo_key)
        if not s.statics_ready:
            raise KernelCacheError(f"{bo_key}: static slots not uploaded; call preload() before the first run")
        if s.calls == 0:
            self._bind_activations(s)
        return s

    def _io(self, s: BOSet, rows: int | None, context: int | None = None) -> tuple[tuple, tuple]:
        """The set's inputs and outputs as (slot, view, BO, bytes) for a call on `rows` rows
        and, for KV-cache slots, the first `context` positions.

        For whole slots (every decode call) they are resolved once, when the set's activations
        are bound: walking all of a group's slots on each call, most of them weights, and slicing
        views for the few it moves cost a few percent of a decode step (docs/profile.md,
        "Around the calls")."""
        moved: dict[Role, list] = {Role.INPUT: [], Role.OUTPUT: []}
        for i, slot in enumerate(s.group.slots):
            if slot.role not in moved:
                continue
            if slot.cache_positions and context is not None:
                moved[slot.role].append(self._cache_io(s, i, context))
            else:
                n = self._span(s.group, slot, rows)
                moved[slot.role].append((slot, self._view(s, i, n), s.bos[i], n))
        return tuple(moved[Role.INPUT]), tuple(moved[Role.OUTPUT])

    def _cache_io(self, s: BOSet, i: int, context: int) -> tuple:
        """A KV-cache slot [heads, ctx, dim] as its first `context` positions of each head, and
        the bytes of one head's: only those are written and synced, head by head. The rest of
        the buffer keeps what an earlier call left (finite values or zeros), which no real row
        attends to."""
        slot = s.group.slots[i]
        _, ctx, dim = slot.shape
        if not 0 < context <= ctx:
            raise ValueError(f"{s.group.name}: context={context} outside 1..{ctx}")
        whole = self._view(s, i, slot.nbytes)
        if context == ctx:
            return slot, whole, s.bos[i], slot.nbytes
        return slot, whole[:, :context], s.bos[i], context * dim * whole.element_size()

    @staticmethod
    def _view(s: BOSet, i: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of slot i's BO as its dtype, shaped [rows, ...]; the whole slot's view is kept."""
        slot = s.group.slots[i]
        if nbytes == slot.nbytes and i in s.views:
            return s.views[i]
        rows = nbytes // (slot.nbytes // slot.shape[0])
        view = s.bos[i].map()[:nbytes].view(slot.torch_dtype).view((rows,) + slot.shape[1:])
        if nbytes == slot.nbytes:
            s.views[i] = view
        return view

    @staticmethod
    def _span(group: KernelGroup, slot, rows: int | None) -> int:
        if rows is None or not slot.token_major:
            return slot.nbytes
        if not 0 < rows <= group.seq_len:
            raise ValueError(f"{group.name}: rows={rows} outside 1..{group.seq_len}")
        return slot.nbytes // slot.shape[0] * rows

    # ---- accounting ---------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the buffers allocated: weights, and activations (every pool's buffer once;
        sub-buffers allocate nothing)."""
        return {"static": sum(b.size for b in self._statics.values()),
                "activations": sum(b.size for b in self._pools.values()),
                "state": sum(b.size for b in self._states.values())}

    def activation_bytes_by_pool(self) -> dict[str, int]:
        """The activation buffers' bytes by pool: a group kind's inputs and outputs, or the
        intermediates every group shares."""
        out: dict[str, int] = {}
        for (owner, _), b in self._pools.items():
            out[owner] = out.get(owner, 0) + b.size
        return out


def shared_slot(name: str, share_key: str) -> tuple[str, str]:
    """Whose buffer a weight or state slot is: a group of several layers names layer i's
    slot `layer_slot(i, name)`, the same buffer as `name` in a per-layer set shared as "L{i}";
    any other slot is its set's `share_key`'s."""
    layered = split_layer_slot(name)
    return (f"L{layered[0]}", layered[1]) if layered else (share_key, name)


def activation_pool(group: KernelGroup, slot) -> tuple[str, str]:
    """Which shared buffer an activation slot uses. Calls are sequential, so nothing one call
    leaves in an activation buffer is needed once the next call of the same kind has run:

    - inputs and outputs: one buffer per (kind, slot name), shared by every bucket of the kind
      (a prefill chunk runs all its layers in one bucket; an output is read, or copied into the
      next group's input, before the next call of its kind);
    - intermediates: no host access and nothing left between calls, so every group's i-th
      largest intermediate uses the same scratch buffer.
    """
    if slot.role is Role.INTERMEDIATE:
        ranked = sorted(group.with_role(Role.INTERMEDIATE), key=lambda s: -s.nbytes)
        return "intermediate", str(ranked.index(slot))
    if slot.role in (Role.STATIC, Role.STATE):
        what = "a weight" if slot.role is Role.STATIC else "resident state"
        raise ValueError(f"{group.name}.{slot.name} is {what}, not an activation")
    return group.kind, slot.name
