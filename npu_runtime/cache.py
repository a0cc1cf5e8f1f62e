"""KernelCache: compile each group once, persist it, load it once per process, run it on BO sets.

Disk: one folder per target kind and group entry, `<target kind>/<group name>-<key>`, so the
simulated and the NPU targets never replace each other's entries. The key hashes the target
kind, the group's declaration, the builder sources and the device's `toolchain_stamp()`:
what decides the artifact's contents *for that target* (and, on the interpreter, whose
artifact is the module text, that text). The NPU target's stamp names its
artifact format, not the compiler's path, so a machine that has the ELFs but no compiler (or
another PATH) finds them; the toolchain that built an entry is recorded in its manifest, and
an entry is rebuilt for a new toolchain only when asked (`refresh_toolchain`). The folder
holds the artifact files and a `manifest.json` (written last) with each file's SHA-256. An
entry is used only if its manifest matches the key and every file matches its hash; anything
else (a truncated ELF, an edited program) is rebuilt. A build happens in a temporary folder
under a file lock and is renamed into place, so a killed compile never leaves a half-written
entry that a later run would trust.

A load that fails on a valid entry is rebuilt once on a device that says a rebuild can fix it
(`rebuild_on_load_error`, the simulated device); on the NPU the driver's error is the answer,
and rebuilding would only repeat a long compile that fails the same way.

BOs: a *BO set* (`bo_key`, per layer: f"{group}_L{layer}") holds a group's static slots.
Statics are written once by `preload`; with a `share_key` (the layer) the prefill and decode
groups of a layer use one BO per weight, so weights are resident once. Input, intermediate
and output slots are activations: one BO per (group, slot), shared by every layer's set,
because calls are sequential. On every call the host writes only `input` slots and reads back
only `output` slots; it never touches `static` slots after preload or `intermediate` ones.
All of those sets come from the group declaration.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from filelock import FileLock, Timeout

import kernel_builder
import multi_launch_builder
from kernel_builder.groups import KernelGroup, Role
from llama_base.errors import KernelCacheError
from llama_base.paths import kernels_dir
from npu_runtime.api import DeviceError, Sync, copy_tensor
from npu_runtime.profiler import NULL_PROFILER, Profiler

FORMAT_VERSION = 2     # 2: per-target folders, the toolchain recorded outside the key
# What a compiled artifact is made from: the build-time packages, whole. The run side (this
# package, the model runtime) changes how an artifact is used, never what it contains.
_BUILD_PACKAGES = (kernel_builder, multi_launch_builder)


def builder_sources_hash() -> str:
    h = hashlib.sha256()
    for pkg in _BUILD_PACKAGES:
        root = Path(pkg.__file__).resolve().parent
        for p in sorted(root.rglob("*")):
            if p.suffix not in (".py", ".cc", ".h") or "__pycache__" in p.parts:
                continue
            h.update(f"{pkg.__name__}/{p.relative_to(root)}".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class CacheStats:
    compiled: int = 0           # entries built in this process
    loaded_from_disk: int = 0   # entries found valid on disk
    rebuilt: int = 0            # entries that existed but were damaged or stale


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


@dataclass
class _Entry:
    group: KernelGroup
    path: Path


class KernelCache:
    def __init__(self, device, cache_dir: Path | None = None, profiler: Profiler | None = None,
                 max_loaded: int | None = None, lock_timeout: float = 600.0, allow_compile: bool = True,
                 refresh_toolchain: bool = False):
        self.device = device
        self.allow_compile = allow_compile
        self.refresh_toolchain = refresh_toolchain
        self.root = Path(cache_dir) if cache_dir is not None else kernels_dir()
        self.dir = self.root / device.kind
        self.profiler = profiler or NULL_PROFILER
        self.max_loaded = max_loaded
        self.lock_timeout = lock_timeout
        self.stats = CacheStats()
        self._entries: dict[str, _Entry] = {}
        self._loaded: OrderedDict[str, object] = OrderedDict()
        self._sets: dict[str, BOSet] = {}
        self._statics: dict[tuple[str, str], object] = {}
        self._acts: dict[tuple[str, str], object] = {}
        self._builder_hash = builder_sources_hash()

    # ---- disk ---------------------------------------------------------------------------
    def entry_key(self, group: KernelGroup) -> str:
        """A device whose artifact is the module text itself (`key_on_module_text`, the
        interpreter) keys on that text too: it can change with no builder source changing
        (a number the builders import from elsewhere), and an entry must never outlive it."""
        parts = [FORMAT_VERSION, self.device.kind, group.fingerprint(), self._builder_hash,
                 self.device.toolchain_stamp()]
        if getattr(self.device, "key_on_module_text", False):
            parts.append(hashlib.sha256(self._mlir(group).encode()).hexdigest())
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def _toolchain_record(self) -> str:
        """What built an entry, for its manifest; a device may describe more than its key stamp."""
        describe = getattr(self.device, "toolchain_description", None)
        return describe() if describe is not None else self.device.toolchain_stamp()

    def _toolchain_changed(self, path: Path) -> bool:
        try:
            recorded = json.loads((path / "manifest.json").read_text()).get("toolchain")
        except (OSError, ValueError, AttributeError):
            return True
        return recorded != self._toolchain_record()

    def _valid(self, path: Path, key: str) -> bool:
        try:
            m = json.loads((path / "manifest.json").read_text())
            if m.get("key") != key or m.get("format") != FORMAT_VERSION:
                return False
            return all(_sha(path / f) == digest for f, digest in m["files"].items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    def compile_and_cache(self, group: KernelGroup) -> Path:
        """The entry folder for `group`, building it unless a valid one is on disk."""
        if group.name in self._entries:
            return self._entries[group.name].path
        key = self.entry_key(group)
        path = self.dir / f"{group.name}-{key[:16]}"
        # A new toolchain is a reason to rebuild only where compiling is allowed and asked for.
        refresh = self.refresh_toolchain and self.allow_compile
        if self._valid(path, key) and not (refresh and self._toolchain_changed(path)):
            self.stats.loaded_from_disk += 1
        elif not self.allow_compile:
            raise KernelCacheError(f"{group.name} is not in the kernel cache {self.dir} (or is stale); "
                                   "run `make compile` first")
        else:
            self._build_locked(group, key, path)
        self._entries[group.name] = _Entry(group, path)
        return path

    def _writable(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = Path(tempfile.mkstemp(prefix=".probe-", dir=self.dir)[1])
            probe.unlink()
        except OSError as e:
            raise KernelCacheError(f"kernel cache folder {self.dir} is not writable ({e.strerror or e}); "
                                   "set LLAMA_NPU_CACHE to a writable folder, or use --run-only with a "
                                   "complete cache") from None

    def _build_locked(self, group: KernelGroup, key: str, path: Path) -> None:
        self._writable()
        try:
            lock = FileLock(str(self.dir / f".{group.name}.lock"), timeout=self.lock_timeout)
            with lock:
                if self._valid(path, key) and not (self.refresh_toolchain and self._toolchain_changed(path)):
                    self.stats.loaded_from_disk += 1     # another process built it while we waited
                    return
                # Left by a killed compile, here or at the root, where entries lived before
                # folders were per target (those old entries can never match a key again).
                for where, pattern in ((self.dir, f".tmp-{group.name}-*"), (self.root, f".tmp-{group.name}-*"),
                                       (self.root, f"{group.name}-*")):
                    for orphan in where.glob(pattern):
                        if orphan.is_dir():
                            shutil.rmtree(orphan, ignore_errors=True)
                self._build(group, key, path)
        except Timeout:
            raise KernelCacheError(f"timed out waiting for another compile of {group.name} "
                                   f"(lock {self.dir}/.{group.name}.lock)") from None

    def _build(self, group: KernelGroup, key: str, path: Path) -> None:
        existed = path.exists()
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{group.name}-", dir=self.dir))
        try:
            files = self.device.compile(group, tmp, self._mlir(group))
            manifest = {"format": FORMAT_VERSION, "key": key, "group": group.name, "target": self.device.kind,
                        "toolchain": self._toolchain_record(), "created": time.time(),
                        "files": {f: _sha(tmp / f) for f in files}}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            if existed:
                shutil.rmtree(path)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for stale in self.dir.glob(f"{group.name}-*"):     # older keys of this group
            if stale != path and stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        self.stats.compiled += 1
        self.stats.rebuilt += int(existed)

    @staticmethod
    def _mlir(group: KernelGroup) -> str:
        """The stitched, validated MLIR-AIR module: generated for every device, compiled only for the NPU.

        The build pipeline (builders, stitcher, IREE's parser) is imported here, on a cache
        miss, not with this module: a run that finds every entry never loads it."""
        from multi_launch_builder.compile import compile_group_mlir

        return compile_group_mlir(group)

    # ---- loading ------------------------------------------------------------------------
    def group(self, name: str) -> KernelGroup:
        try:
            return self._entries[name].group
        except KeyError:
            raise KeyError(f"{name} was not compiled in this KernelCache (call compile_and_cache first)") from None

    def _kernel(self, name: str):
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return self._loaded[name]
        entry = self._entries[name]
        try:
            kernel = self.device.load(entry.path, entry.group)
        except Exception as e:
            if not getattr(self.device, "rebuild_on_load_error", True):
                if isinstance(e, DeviceError):
                    raise
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise DeviceError(f"{name}: loading {entry.path} failed: {first}") from None
            # The entry was valid when checked; if loading still fails, rebuild once.
            shutil.rmtree(entry.path, ignore_errors=True)
            self._build_locked(entry.group, self.entry_key(entry.group), entry.path)
            kernel = self.device.load(entry.path, entry.group)
        self._loaded[name] = kernel
        if self.max_loaded is not None and len(self._loaded) > self.max_loaded:
            self._loaded.popitem(last=False)      # BOs belong to the device and survive this
        return kernel

    def _bo_set(self, name: str, bo_key: str) -> BOSet:
        s = self._sets.get(bo_key)
        if s is not None:
            if s.group.name != name:
                raise KeyError(f"bo_key {bo_key!r} belongs to {s.group.name}, not {name}")
            return s
        group = self.group(name)
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
                bo = self.device.bo(slot.nbytes, self._kernel(name), i)
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
        kernel = self._kernel(name)
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
        views for the few it moves measured 1-3 % of a decode step on the Zen 4 VM."""
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
