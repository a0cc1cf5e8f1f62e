"""The model cache's derived artifacts: every folder the runtime makes from something else (the
built-in models, a GGUF's import, a checkpoint's Q4NX weights) is built and trusted one way.

An entry is a folder named by its maker, stamped with what it was made from (`source`: package
versions, a digest of the code that builds it, the files it was made from) and the size of each
file it holds. `ensure` builds it in a temporary sibling and renames it into place under a file
lock, so concurrent processes see either nothing or a complete folder and wait for one build
rather than making two; a crash mid-build leaves no half-folder behind (the next build, holding
the lock, removes its leftovers); an entry whose source changed is made again, and one whose
files were removed or cut short is rebuilt rather than half-trusted, saying why. Once built,
`ensure` costs a few `stat` calls.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from llama_base.paths import models_dir

STAMP_FILE = ".fixture-stamp.json"   # the name the cache's existing entries were stamped with
# Bump when the layout of a stamp or of an entry changes, so that existing caches are rebuilt.
FORMAT_VERSION = 1

# Why an entry is not current (`DerivedStore.state`).
MISSING = "missing"          # no such folder
STALE = "stale"              # made from another source, or by another version of the store
INCOMPLETE = "incomplete"    # its stamp or one of its files is missing, or a file's size differs


def code_digest(*objects) -> str:
    """Digest of the code that makes an entry (modules, functions, classes), so that editing it
    rebuilds the entries the old code made."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()[:16]


def file_sizes(folder: Path) -> dict[str, int]:
    """The size of each file of `folder` but its stamp: what a stamp records, and what an entry
    made from another entry's files can name as its source."""
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAMP_FILE}


class DerivedStore:
    """The entries under one folder (`root`, the model cache unless given): built by `ensure`,
    looked at by `state` and `source_of`, removed by `remove`."""

    def __init__(self, root: Path | None = None):
        self._root = root

    @property
    def root(self) -> Path:
        """Asked for on every use: the cache root follows `$LLAMA_NPU_CACHE` as it is now."""
        return self._root if self._root is not None else models_dir()

    def path(self, name: str) -> Path:
        return self.root / name

    def holds(self, folder: Path) -> bool:
        """Whether `folder` is one of this store's entries (remade in place when its source
        changes), not a folder of the user's."""
        return Path(folder).resolve().parent == self.root.resolve()

    def lock(self, name: str, timeout: float = -1) -> FileLock:
        """The lock a build of the entry `name` holds, for whoever else would change the entry:
        taken with `timeout` 0, it fails while a build is under way."""
        return FileLock(str(self.root / f".{name}.lock"), timeout=timeout)

    def _stamp(self, name: str) -> dict | None:
        try:
            stamp = json.loads((self.path(name) / STAMP_FILE).read_text())
        except (OSError, ValueError):
            return None
        return stamp if isinstance(stamp, dict) else None

    def source_of(self, name: str) -> dict | None:
        """The source the entry `name` was stamped with, or None without a readable stamp."""
        stamp = self._stamp(name)
        if stamp is None:
            return None
        source = stamp.get("source", {})
        return source if isinstance(source, dict) else None

    def state(self, name: str, source: dict) -> str | None:
        """None when the entry `name` was completely built from `source` and no file was removed
        or resized since; else why not (`MISSING`, `STALE`, `INCOMPLETE`)."""
        folder = self.path(name)
        if not folder.is_dir():
            return MISSING
        stamp = self._stamp(name)
        if stamp is None:
            return INCOMPLETE
        if stamp.get("format") != FORMAT_VERSION or stamp.get("source") != source:
            return STALE
        try:
            sizes_match = all((folder / f).stat().st_size == size for f, size in stamp["files"].items())
        except (OSError, KeyError, TypeError, AttributeError):
            sizes_match = False
        return None if sizes_match else INCOMPLETE

    def is_current(self, name: str, source: dict) -> bool:
        return self.state(name, source) is None

    def ensure(self, name: str, source: dict, build: Callable[[Path], None],
               intact: Callable[[Path], str | None] | None = None,
               log: Callable[[str], None] | None = None) -> Path:
        """The entry `name` made from `source`: as it is when current, else made by `build`
        (which fills the empty folder it is given). `intact`, when given, looks deeper than
        the stamp's sizes (a digest of the contents) and says what is damaged, or None. With
        `log`, a rebuild of an entry that was cut short or damaged says why."""
        path = self._ensure(name, source, build, log)
        damage = intact(path) if intact is not None else None
        if damage is not None:
            if log is not None:
                log(f"{damage}: rebuilding it")
            with self.lock(name):
                shutil.rmtree(path, ignore_errors=True)
            path = self._ensure(name, source, build, None)
        return path

    def _ensure(self, name: str, source: dict, build: Callable[[Path], None],
                log: Callable[[str], None] | None) -> Path:
        target = self.path(name)
        state = self.state(name, source)
        if state is None:
            return target
        if state == INCOMPLETE and log is not None:
            log(f"{target} is incomplete (a file is missing or its size differs from its stamp): rebuilding it")
        target.parent.mkdir(parents=True, exist_ok=True)
        with self.lock(name):
            if self.is_current(name, source):  # another process finished it while we waited
                return target
            # Holding the lock, any leftover build folder is from a crashed build: remove it.
            for stale in target.parent.glob(f".{name}.build-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=target.parent))
            try:
                tmp.chmod(0o755)  # mkdtemp makes it private
                build(tmp)
                for f in tmp.iterdir():
                    f.chmod(0o644)  # some writers create private files; the cache root's permissions should rule
                stamp = {"format": FORMAT_VERSION, "source": source, "files": file_sizes(tmp)}
                (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
                if target.exists():
                    old = target.parent / f".{name}.build-old"
                    os.rename(target, old)
                    os.rename(tmp, target)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return target

    def names(self, pattern: re.Pattern) -> list[str]:
        """The entries whose whole name matches `pattern`, and those of lock files whose entry no
        longer exists (a build that was removed, or never finished)."""
        if not self.root.is_dir():
            return []
        found = {p.name for p in self.root.iterdir() if p.is_dir() and pattern.fullmatch(p.name)}
        for lock_file in self.root.glob(".*.lock"):
            name = lock_file.name[1:-len(".lock")]
            if pattern.fullmatch(name):
                found.add(name)
        return sorted(found)

    def remove(self, name: str) -> int | None:
        """Remove the entry `name` (if it still exists) and then its lock file, holding the lock:
        the bytes freed, or None, with nothing removed, while another process holds the lock."""
        entry = self.path(name)
        try:
            with self.lock(name, timeout=0) as lock:
                size = 0
                if entry.exists():
                    size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
                    shutil.rmtree(entry)
                Path(lock.lock_file).unlink(missing_ok=True)
        except (Timeout, OSError):
            return None
        return size


MODELS = DerivedStore()   # the model cache: every derived checkpoint and weight file the runtime makes
