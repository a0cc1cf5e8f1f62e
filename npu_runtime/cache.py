"""KernelCache: a group's buffer sets, uploaded once, and its runs, over an `ArtifactCache`.

BOs: a *BO set* (`bo_key`, per layer: f"{group}_L{layer}") holds a group's static slots.
Statics are written once by `preload`; with a `share_key` (the layer) the prefill and decode
groups of a layer use one BO per weight, so weights are resident once. Input, intermediate
and output slots are activations: one BO per (group, slot), shared by every layer's set,
because calls are sequential. On every call the host writes only `input` slots and reads back
only `output` slots; it never touches `static` slots after preload or `intermediate` ones.
All of those sets come from the group declaration.

The compiled artifacts, their disk cache and the loaded kernels are the `ArtifactCache`'s
(`artifacts`); this class only asks it for a group's kernel.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernel_builder.groups import KernelGroup, Role
from llama_base.errors import KernelCacheError
from npu_runtime.api import BO, Device, Sync, copy_tensor
from npu_runtime.artifacts import ArtifactCache, CacheStats
from npu_runtime.profiler import NULL_PROFILER, Profiler


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


class KernelCache:
    def __init__(self, device: Device, cache_dir: Path | None = None, profiler: Profiler | None = None,
                 max_loaded: int | None = None, lock_timeout: float = 600.0, allow_compile: bool = True,
                 refresh_toolchain: bool = False):
        self.device = device
        self.artifacts = ArtifactCache(device, cache_dir, max_loaded, lock_timeout, allow_compile, refresh_toolchain)
        self.profiler = profiler or NULL_PROFILER
        self._sets: dict[str, BOSet] = {}
        self._statics: dict[tuple[str, str], BO] = {}
        self._acts: dict[tuple[str, str], BO] = {}

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
        # Statics are filled by preload, activations on the set's first run: a bucket that is
        # never used never allocates its activation buffers.
        s = self._sets[bo_key] = BOSet(group, [None] * len(group.slots))
        return s

    def _bind_activations(self, s: BOSet) -> None:
        for i, slot in enumerate(s.group.slots):
            if slot.role is not Role.STATIC and s.bos[i] is None:
                key = (s.group.name, slot.name)
                if key not in self._acts:
                    self._acts[key] = self.device.bo(slot.nbytes)
                s.bos[i] = self._acts[key]
        s.io = self._io(s, None)

    def preload(self, name: str, bo_key: str, statics: dict[str, torch.Tensor], share_key: str | None = None) -> None:
        """Upload a BO set's static slots once. With `share_key`, reuse another group's identical weight BO."""
        s = self._bo_set(name, bo_key)
        for i, slot in enumerate(s.group.slots):
            if slot.role is not Role.STATIC or s.bos[i] is not None:
                continue
            pool_key = (share_key, slot.name) if share_key is not None else (bo_key, slot.name)
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
                     rows: int | None = None) -> dict[str, torch.Tensor]:
        """Write the inputs, run, read back the outputs (views valid until the group's next call).

        `rows` limits the host's writes and reads to the first rows of row-major activations
        (a prompt shorter than its bucket): rows past it are padding that, by causality,
        never influences the real ones.
        """
        kernel = self.artifacts.kernel(name)
        s = self._bo_set(name, bo_key)
        if not s.statics_ready:
            raise KernelCacheError(f"{bo_key}: static slots not uploaded; call preload() before the first run")
        if s.calls == 0:
            self._bind_activations(s)
        prof = self.profiler.enabled
        t0 = time.perf_counter() if prof else 0.0
        ins, outs = s.io if rows is None else self._io(s, rows)
        for slot, view, bo, nbytes in ins:
            t = inputs[slot.name]
            if t.numel() != view.numel():
                raise ValueError(f"{name}.{slot.name}: {t.numel()} elements for a {nbytes}-byte span of {slot.shape}")
            if t.dtype == view.dtype and t.is_contiguous():
                copy_tensor(view, t)
            else:
                view.view(-1).copy_(t.reshape(-1))
            bo.sync(Sync.TO_DEVICE, nbytes)
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

    def _io(self, s: BOSet, rows: int | None) -> tuple[tuple, tuple]:
        """The set's inputs and outputs as (slot, view, BO, bytes) for a call on `rows` rows.

        For whole slots (every decode call) they are resolved once, when the set's activations
        are bound: walking all of a group's slots on each call, most of them weights, and slicing
        views for the few it moves cost a few percent of a decode step (docs/profile.md,
        "Around the calls")."""
        moved: dict[Role, list] = {Role.INPUT: [], Role.OUTPUT: []}
        for i, slot in enumerate(s.group.slots):
            if slot.role in moved:
                n = self._span(s.group, slot, rows)
                moved[slot.role].append((slot, self._view(s, i, n), s.bos[i], n))
        return tuple(moved[Role.INPUT]), tuple(moved[Role.OUTPUT])

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
        return {"static": sum(b.size for b in self._statics.values()),
                "activations": sum(b.size for b in self._acts.values())}
