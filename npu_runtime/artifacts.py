"""ArtifactCache: compile each group once, persist it, load it once per process.

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

A group's name does not say its shapes: the embedded model, Llama-3.2-1B and the bench's
shapes each declare a `rms_gemv_rope`. So a build drops only what can never be used again,
the older builds of its own declaration (same declaration, other builder sources or stamp),
and keeps the entries of `DECLARATIONS_KEPT` declarations per group, the most recently used:
switching models reuses each model's artifacts instead of running aircc again.

A load that fails on a valid entry is rebuilt once on a device that says a rebuild can fix it
(`rebuild_on_load_error`, the simulated device); on the NPU the driver's error is the answer,
and rebuilding would only repeat a long compile that fails the same way.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from llama_base.group_contract import KernelGroup
from llama_base.errors import KernelCacheError
from llama_base.paths import kernels_dir
from multi_launch_builder.sources import builder_sources_hash
from npu_runtime.api import Device, DeviceError, Kernel

# Bump when an entry's layout or manifest changes: entries written in another layout are rebuilt, never read.
FORMAT_VERSION = 2
# Entries kept per group name and target: one per declaration, so that about this many models
# (each its own shapes) alternate without recompiling. Past it the least recently used goes.
DECLARATIONS_KEPT = 4


def _manifest(entry: Path) -> dict:
    """An entry's manifest; {} when it is missing or unreadable (the entry is then invalid)."""
    try:
        m = json.loads((entry / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return m if isinstance(m, dict) else {}


def _touch(entry: Path) -> None:
    """Mark an entry built or used (its folder's mtime), for the sweep's least-recently-used
    order; a read-only cache simply keeps its order. The time is the clock's own, in ns: the
    kernel stamps a folder with a coarse clock, whose ticks (milliseconds) two entries made in
    quick succession can share."""
    now = time.time_ns()
    try:
        os.utime(entry, ns=(now, now))
    except OSError:
        pass


def _used(entry: Path) -> int:
    try:
        return entry.stat().st_mtime_ns
    except OSError:
        return 0


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
class _Entry:
    group: KernelGroup
    path: Path


class ArtifactCache:
    def __init__(self, device: Device, cache_dir: Path | None = None, max_loaded: int | None = None,
                 lock_timeout: float = 600.0, allow_compile: bool = True, refresh_toolchain: bool = False):
        self.device = device
        self.allow_compile = allow_compile
        self.refresh_toolchain = refresh_toolchain
        self.root = Path(cache_dir) if cache_dir is not None else kernels_dir()
        self.dir = self.root / device.kind
        self.max_loaded = max_loaded
        self.lock_timeout = lock_timeout
        self.stats = CacheStats()
        self._entries: dict[str, _Entry] = {}
        self._loaded: OrderedDict[str, Kernel] = OrderedDict()
        self._builder_hash = builder_sources_hash()

    # ---- disk ---------------------------------------------------------------------------
    def entry_key(self, group: KernelGroup) -> str:
        """A device whose artifact is the module text itself (the interpreter) keys on that text
        too: it can change with no builder source changing (a number the builders import from
        elsewhere), and an entry must never outlive it."""
        parts = [FORMAT_VERSION, self.device.kind, group.fingerprint(), self._builder_hash,
                 self.device.toolchain_stamp()]
        if self.device.key_on_module_text:
            parts.append(hashlib.sha256(self._mlir(group).encode()).hexdigest())
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def _toolchain_record(self) -> str:
        """What built an entry, for its manifest; a device may describe more than its key stamp."""
        return self.device.toolchain_description()

    def _toolchain_changed(self, path: Path) -> bool:
        return _manifest(path).get("toolchain") != self._toolchain_record()

    def _valid(self, path: Path, key: str) -> bool:
        m = _manifest(path)
        if m.get("key") != key or m.get("format") != FORMAT_VERSION:
            return False
        try:
            return all(_sha(path / f) == digest for f, digest in m["files"].items())
        except (OSError, KeyError, TypeError, AttributeError):
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
            _touch(path)
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
                # Left by a killed compile, here or at the root (where the format-1 layout kept
                # entries, which can never match a key again).
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
        declaration = group.fingerprint()
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{group.name}-", dir=self.dir))
        try:
            files = self.device.compile(group, tmp, self._mlir(group))
            manifest = {"format": FORMAT_VERSION, "key": key, "group": group.name, "target": self.device.kind,
                        "declaration": declaration, "toolchain": self._toolchain_record(), "created": time.time(),
                        "files": {f: _sha(tmp / f) for f in files}}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            if existed:
                shutil.rmtree(path)
            os.rename(tmp, path)
            _touch(path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._sweep(group.name, declaration, path)
        self.stats.compiled += 1
        self.stats.rebuilt += int(existed)

    def _sweep(self, name: str, declaration: str, built: Path) -> None:
        """After a build of group `name` (under its lock): remove the older builds of its
        `declaration`, and the other declarations' entries past the `DECLARATIONS_KEPT` most
        recently used. An entry whose manifest names no declaration counts as another's."""
        others = []
        for entry in self.dir.glob(f"{name}-*"):
            if entry == built or not entry.is_dir():
                continue
            if _manifest(entry).get("declaration") == declaration:
                shutil.rmtree(entry, ignore_errors=True)
            else:
                others.append((_used(entry), entry))
        for _, entry in sorted(others, reverse=True)[DECLARATIONS_KEPT - 1:]:
            shutil.rmtree(entry, ignore_errors=True)

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

    def groups(self) -> list[KernelGroup]:
        """Every group compiled (or found on disk) in this cache so far."""
        return [e.group for e in self._entries.values()]

    def kernel(self, name: str) -> Kernel:
        """The loaded kernel of a compiled group; the least recently used is dropped past `max_loaded`."""
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return self._loaded[name]
        entry = self._entries[name]
        try:
            kernel = self.device.load(entry.path, entry.group)
        except Exception as e:
            if not self.device.rebuild_on_load_error:
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
