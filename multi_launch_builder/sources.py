"""What a compiled artifact is made from, as one digest: the build-time packages, whole, and the
contract the builders declare groups in, which lives below them. The run side changes how an
artifact is used, never what it contains, so it is left out. Everything keyed by what the
builders would make (the kernel cache's entries, the cost model's counts, the shape check's
verdicts) keys on this."""
from __future__ import annotations

import hashlib
from pathlib import Path

import kernel_builder
import multi_launch_builder
from llama_base import group_contract, weight_formats

_BUILD_PACKAGES = (kernel_builder, multi_launch_builder)
_BUILD_MODULES = (group_contract, weight_formats)


def builder_sources_hash() -> str:
    h = hashlib.sha256()
    for pkg in _BUILD_PACKAGES:
        root = Path(pkg.__file__).resolve().parent
        for p in sorted(root.rglob("*")):
            if p.suffix not in (".py", ".cc", ".h") or "__pycache__" in p.parts:
                continue
            h.update(f"{pkg.__name__}/{p.relative_to(root)}".encode())
            h.update(p.read_bytes())
    for mod in _BUILD_MODULES:
        h.update(mod.__name__.encode())
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()
