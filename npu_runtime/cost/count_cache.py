"""The counts of a group's stitched module, kept in memory and on disk.

Building a fused decode module takes seconds (281 launches stitched and validated) and the
cost model prices a dozen of them for one table, so `make profile` and the bench would spend
most of a minute rebuilding what an earlier run counted. An entry is keyed on the group's
declaration, the i32 scalars the walk reads, and the sources of everything the count depends
on (the builders and the contract they declare groups in, the counter and the parser it
reads modules with): editing any of them makes every entry stale, never wrong.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import llama_base
from llama_base.group_contract import KernelGroup
from llama_base.paths import cache_dir
from multi_launch_builder.compile import compile_group_mlir
from npu_runtime.cost import counts as _counts
from npu_runtime.cost.counts import LaunchCounts, Work, count_module
from npu_runtime.interp import program as _program

FORMAT_VERSION = 1


@lru_cache(maxsize=1)
def sources_hash() -> str:
    """The builders' sources (the KernelCache's own hash of them), the package they import their
    numbers from, and the counter's."""
    from multi_launch_builder.sources import builder_sources_hash

    h = hashlib.sha256(builder_sources_hash().encode())
    root = Path(llama_base.__file__).resolve().parent
    for p in sorted(root.rglob("*.py")):
        h.update(p.read_bytes())
    for mod in (_counts, _program):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def _key(group: KernelGroup, scalars: dict[int, int]) -> str:
    parts = [FORMAT_VERSION, group.fingerprint(), sorted(scalars.items()), sources_hash()]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _path(key: str) -> Path:
    return cache_dir("cost") / f"{key[:2]}" / f"{key}.json"


def _read(path: Path) -> tuple[LaunchCounts, ...] | None:
    try:
        rows = json.loads(path.read_text())
        return tuple(LaunchCounts(name, Work(**work)) for name, work in rows)
    except (OSError, ValueError, TypeError):
        return None


def _write(path: Path, counts: tuple[LaunchCounts, ...]) -> None:
    """Written to a temporary sibling and renamed, so a reader sees a whole entry or none; a
    cache that cannot be written is only slower."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump([[c.name, asdict(c.work)] for c in counts], f)
        os.replace(tmp, path)
    except OSError:
        pass


@lru_cache(maxsize=512)
def _cached(group: KernelGroup, scalars: tuple[tuple[int, int], ...]) -> tuple[LaunchCounts, ...]:
    s = dict(scalars)
    path = _path(_key(group, s))
    got = _read(path)
    if got is None:
        got = tuple(count_module(compile_group_mlir(group), s))
        _write(path, got)
    return got


def cached_counts(group: KernelGroup, scalars: dict[int, int] | None = None) -> tuple[LaunchCounts, ...]:
    """`count_module` of the group's stitched module with `scalars` (i32 arguments by index),
    from the cache when an earlier count of the same declaration and sources is there. The
    counts are shared: a caller must not change them."""
    return _cached(group, tuple(sorted((scalars or {}).items())))


__all__ = ["cached_counts", "sources_hash"]
