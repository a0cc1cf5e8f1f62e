"""`QUANT=q4nx`: a checkpoint's linear weights in Q4NX, made once and cached beside the imported models.

What is quantized: every linear weight of every layer (Q, K, V, O, gate, up, down) and the LM
head (its rows padded to whole row-blocks). What stays bf16: the norms and the embedding table,
which the host reads a row at a time, so their bytes never limit a token. The LM head is
quantized because it is a fifth of Llama-3.2-1B's weights and decode reads all of it every
token: kept bf16 it would cost nearly as much as every layer's Q4NX weights together. What a
4-bit head costs in quality is won back on the host, which recomputes the leading logits from
the bf16 rows (`head_rescore`; docs/explain.md has the measured perplexities).

Where the weights come from: a GGUF (the embedded model's, or a user's `MODEL=x.gguf`) whose
linear tensors are Q4_1 (the embedded model), Q4_0 or Q4_K keeps its 4-bit values exactly and
only rounds its scales and mins to bf16 (`quantize.q4_1_to_q4nx`). Such a file's linear tensors
of a wider type stay wide, in bf16 (`gguf_plan`): llama.cpp's Q4_K_M gives the V and down
projections of some layers (half of Llama-3.2-1B's) 6 bits, and taking them to 4 would lose
what the file's maker paid for. Those layers then run group variants with a bf16 GEMV or GEMM
for those weights (`KernelGroup.wide`). Everything else (a bf16 checkpoint, a GGUF with no
4-bit linear tensor) is quantized from bf16 (`quantize.quantize`).

The cache: `models/q4nx-<folder>-<key>/weights.safetensors` (U8 tensors holding each matrix's
Q4NX bytes, BF16 ones for the weights kept wide) with its digest beside it (`_digest`). The
key hashes what decides the bytes: the source checkpoint's safetensors headers, sizes and
modification times (and the GGUF's name, size and package version or modification time), and
the code of the format and the quantizer. A build is an entry of the model cache's store
(`store.MODELS`): made once, under a lock, into a temporary folder renamed into place, so a
crash leaves nothing half-written; a file cut short, or whose hash no longer matches (damaged
on disk), is rebuilt. A new build removes the ones it replaces: those of the same checkpoint
made by older code or from another install of its GGUF, and those the model cache's own
imports made from their older files.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from llama_base import q4nx
from llama_base.config import LlamaConfig, layer_shapes
from llama_base.errors import CheckpointError
from llama_base.tensor_names import LM_HEAD, layer_tensor
from llama_runtime.checkpoints.gguf import importer, reader
from llama_runtime.checkpoints.gguf.importer import GGUFOrigin
from llama_runtime.checkpoints.gguf.reader import GGUFFile
from llama_runtime.checkpoints import quantize
from llama_runtime.checkpoints.safetensors_io import Checkpoint
from llama_runtime.checkpoints.store import MISSING, MODELS, code_digest
from llama_runtime.checkpoints.weights import LayerWeights, LlamaWeights

FORMAT = 2          # 2: a linear weight may be stored in bf16 (kept wide)
WEIGHTS_FILE = "weights.safetensors"
DIGEST_FILE = "weights.digest"


def linear_names(cfg: LlamaConfig) -> list[str]:
    """The short names of a layer's linear weights (the matrices Q4NX holds)."""
    return [n for n, shape in layer_shapes(cfg).items() if len(shape) == 2]


def lm_head_rows(cfg: LlamaConfig) -> int:
    """The LM head's rows as stored: the vocabulary padded to whole row-blocks."""
    return -(-cfg.vocab_size // q4nx.ROWS) * q4nx.ROWS


# The digest a cache keeps of its weights: the SHA-256 of the SHA-256s of its 64 MiB pieces in
# order, so that every core hashes pieces side by side (hashlib and the reads release the GIL).
# It is checked on every load: for the 1B shape's 0.77 GB on the 2-core Zen 3, 0.31 s where one
# stream over the file took 0.62.
DIGEST_SCHEME = "sha256-of-64MiB-pieces"
PIECE_BYTES = 64 << 20
READ_BYTES = 4 << 20      # a thread's buffer: many threads must not raise the load's peak memory


def _digest(path: Path) -> str:
    size = path.stat().st_size

    def piece(start: int) -> bytes:
        h, buf = hashlib.sha256(), memoryview(bytearray(READ_BYTES))
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            left = min(PIECE_BYTES, size - start)
            while left > 0 and (n := f.readinto(buf[:min(left, READ_BYTES)])):
                h.update(buf[:n])
                left -= n
        return h.digest()

    starts = range(0, max(size, 1), PIECE_BYTES)
    with ThreadPoolExecutor(min(len(starts), os.cpu_count() or 1)) as pool:
        pieces = b"".join(pool.map(piece, starts))
    return f"{DIGEST_SCHEME}:{hashlib.sha256(pieces).hexdigest()}"


def _damage(folder: Path) -> str | None:
    """What is wrong with a build whose stamp holds (`store.DerivedStore.ensure`'s deeper look):
    a file whose bytes changed since it was made keeps its size, only its digest can tell."""
    try:
        if (folder / DIGEST_FILE).read_text().strip() == _digest(folder / WEIGHTS_FILE):
            return None
    except OSError:
        pass
    return f"{folder / WEIGHTS_FILE} does not match its hash"


def _source_of(folder: Path) -> dict:
    """What identifies a checkpoint's contents without reading them all: each safetensors file's
    name, size, modification time and header."""
    files = {}
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb") as f:
            head = f.read(8)
            header = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
        st = p.stat()
        files[p.name] = [st.st_size, st.st_mtime_ns, hashlib.sha256(header).hexdigest()]
    return {"files": files}


def _gguf_stamp(gguf: GGUFOrigin) -> list:
    """A GGUF as its import is keyed: name, size, and the embedded package's version (when
    `packaged`) or a user's file's modification time. Not the packaged file's time: every new
    environment installs the package afresh, and each would otherwise build, and keep, a copy
    of the same weights."""
    st = gguf.path.stat()
    return [gguf.path.name, st.st_size, importer.smollm2_version() if gguf.packaged else st.st_mtime_ns]


def _quantized_tensors(bf16: LlamaWeights, from_gguf: dict[str, Callable[[], torch.Tensor]], wide: set[str],
                       log: Callable[[str], None]):
    """Yield (name, tensor) for every layer's linear weights and the LM head: Q4NX bytes, or the
    bf16 values of a weight kept `wide`."""
    cfg = bf16.config
    n_layers = cfg.num_hidden_layers
    t0 = time.perf_counter()
    for i, lw in enumerate(bf16.layers):
        for short in linear_names(cfg):
            name = layer_tensor(i, short)
            w = getattr(lw, short)
            yield name, w if name in wide else from_gguf.pop(name)() if name in from_gguf else quantize.quantize(w)
        bf16.release_pages()
        if (i + 1) % max(1, n_layers // 4) == 0 or i + 1 == n_layers:
            log(f"[quant] q4nx: {i + 1}/{n_layers} layers ({time.perf_counter() - t0:.0f} s)")
    yield LM_HEAD, quantize.quantize(quantize.pad_rows(bf16.lm_head))


def _gguf_kinds():
    """GGUF tensor types by what Q4NX does with them: 4-bit affine types with 32-weight groups
    whose values it keeps (their fields as Q4_1's, `quantize.q*_fields`), and wider types it
    quantizes from their values like a bf16 checkpoint's."""
    from gguf import GGMLQuantizationType as T

    held = {T.Q4_0: quantize.q4_0_fields, T.Q4_1: quantize.q4_1_fields, T.Q4_K: quantize.q4_k_fields}
    wider = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q6_K, T.Q5_0, T.Q5_1, T.Q5_K}
    return held, wider


def gguf_plan(file: GGUFFile, cfg: LlamaConfig) -> tuple[list, set[str]]:
    """What Q4NX does with a GGUF's linear weights: (held, wide).

    held: (tensor, HF name, short name, shape, the function reading its fields) of each weight
    whose 4-bit values Q4NX keeps. wide: the HF names of the weights of a wider type kept in
    bf16, in a file that holds 4-bit ones too (a Q4_K_M file keeps some in Q6_K); in a file
    with none (F16, Q8_0 throughout), every weight is quantized from its values like a bf16
    checkpoint's, since QUANT=q4nx asks for 4 bits. Any other type (2- and 3-bit k-quants, the
    non-linear IQ types) is refused, naming the tensor: holding it would put a second rounding
    on values coarser than Q4NX's own, and is refused before a file's import begins
    (`builtin.ensure_gguf_model`)."""
    kinds, wider = _gguf_kinds()
    held, wide = [], set()
    for t in importer.weight_tensors(file):
        name, short, shape = importer.gguf_tensor_name(t.name, cfg)
        if len(shape) != 2 or short == "":
            continue
        if t.tensor_type in wider:
            wide.add(name)
        elif t.tensor_type in kinds:
            held.append((t, name, short, shape, kinds[t.tensor_type]))
        else:
            raise CheckpointError(f"{file.path.name}: tensor {t.name!r} is {t.tensor_type.name}, which QUANT=q4nx "
                                  "cannot hold (it keeps Q4_0, Q4_1 and Q4_K values, and wider types in bf16 or quantized); "
                                  "QUANT=bf16 runs the file from its dequantized values")
    return held, wide if held else set()


def wide_sets(gguf: GGUFOrigin | None, cfg: LlamaConfig) -> tuple[frozenset[str], ...]:
    """The distinct sets of linear weights a layer of a Q4NX build from `gguf` (a resolved
    model's, `ResolvedModel.gguf`) keeps in bf16, in layer order (`gguf_plan`;
    `LlamaWeights.wide_sets` of the loaded build), read from the GGUF's header without building
    anything: the group variants `make compile` compiles."""
    wide = gguf_plan(importer.open_gguf(gguf.path), cfg)[1] if gguf is not None else set()
    layers = [frozenset(s for s in linear_names(cfg) if layer_tensor(i, s) in wide)
              for i in range(cfg.num_hidden_layers)]
    return tuple(dict.fromkeys(layers))


def _gguf_tensors(path: Path, cfg: LlamaConfig) -> tuple[dict[str, Callable[[], torch.Tensor]], set[str]]:
    """The GGUF's 4-bit linear weights, each as a function making its Q4NX bytes with their
    values kept, and the names of those kept wide (`gguf_plan`). The bytes are made when
    written, so a build holds one at a time.

    On a file's first QUANT=q4nx run this reads its 4-bit tensors a second time, after the
    import dequantized them into the bf16 folder, and that cannot be avoided without making the
    two in one pass: the folder cannot give the 4-bit values back (its tensors are q * d + m
    rounded to bf16), and the import and this build are separate cache entries with lives of
    their own (a bf16 run, the HF reference and `make compile` need the import alone; a build
    from a file imported by an earlier run has to read it in any case). One pass would save
    only a second touch of pages the import has just left in the page cache, a few thousandths
    of a first run that both passes spend converting (the import dequantizing, this pass
    repacking fields the import never computes), at the price of tying the two entries' keys,
    locks and rebuilds together."""
    def make(t, short: str, n: int, k: int, fields) -> torch.Tensor:
        q, d, m = fields(t.data, n, k)
        heads = importer.rope_heads(short, cfg)
        if heads:      # rows permuted for llama.cpp's RoPE: every per-row field moves with its row
            q, d, m = (importer.unpermute_rope_rows(x, heads) for x in (q, d, m))
        s, mn = quantize.q4_1_to_q4nx(q, d, m)
        return q4nx.pack(q, s, mn)

    held, wide = gguf_plan(importer.open_gguf(path), cfg)
    return {name: functools.partial(make, t, short, n, k, fields) for t, name, short, (n, k), fields in held}, wide


def _build(bf16: LlamaWeights, gguf: Path | None, out: Path, log: Callable[[str], None]) -> None:
    """The Q4NX weights written as they are made (`writer.write_streaming`)."""
    from llama_runtime.checkpoints.writer import write_streaming

    cfg = bf16.config
    shapes = layer_shapes(cfg)
    from_gguf, wide = _gguf_tensors(gguf, cfg) if gguf is not None else ({}, set())
    specs = []
    for i in range(cfg.num_hidden_layers):
        for short in linear_names(cfg):
            name = layer_tensor(i, short)
            specs.append((name, torch.bfloat16, shapes[short]) if name in wide
                         else (name, torch.uint8, (q4nx.nbytes(*shapes[short]),)))
    specs.append((LM_HEAD, torch.uint8, (q4nx.nbytes(lm_head_rows(cfg), cfg.hidden_size),)))
    if wide:
        size = {name: dtype.itemsize * math.prod(shape) for name, dtype, shape in specs}
        kept = sum(size[name] for name in wide)
        log(f"[quant] q4nx: {len(wide)} linear weights of a wider type in {gguf.name} kept in bf16 "
            f"({kept / 1e6:.0f} MB, {kept / sum(size.values()):.0%} of the build)")
    write_streaming(out / WEIGHTS_FILE, specs, _quantized_tensors(bf16, from_gguf, wide, log),
                    {"format": f"q4nx-{FORMAT}"})
    (out / DIGEST_FILE).write_text(_digest(out / WEIGHTS_FILE) + "\n")


def ensure_q4nx(folder: Path, gguf: GGUFOrigin | None, bf16: LlamaWeights,
                log: Callable[[str], None] = print) -> Path:
    """The cache folder holding `folder`'s weights in Q4NX (with the 4-bit values of the GGUF it
    was imported from, `gguf`), built now if missing, stale or damaged."""
    source = {"format": FORMAT, "q4nx": [q4nx.ROWS, q4nx.COLS, q4nx.GROUP],
              "code": code_digest(q4nx, quantize, reader, _quantized_tensors, _gguf_kinds,
                                  gguf_plan, _gguf_tensors, _build),
              "checkpoint": _source_of(folder)}
    if gguf is not None:
        source["gguf"] = _gguf_stamp(gguf)
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    name = f"q4nx-{folder.name}-{key}"
    built = MODELS.state(name, source) == MISSING
    if built:
        log(f"[quant] making Q4NX weights of {folder.name} (once; cached in {MODELS.path(name)})")
    path = MODELS.ensure(name, source, lambda tmp: _build(bf16, gguf and gguf.path, tmp, log), intact=_damage,
                         log=lambda line: log(f"[quant] {line}"))
    if built:
        _remove_superseded(folder.name, name, source, MODELS.holds(folder), log)
    return path


def _remove_superseded(folder_name: str, current: str, source: dict, owned: bool,
                       log: Callable[[str], None]) -> None:
    """Remove the builds this one replaces: the same checkpoint (its files as stamped, and the
    GGUF) made by another version of the format or the quantizer, or from another install of
    the GGUF; and, for a folder the model cache `owned` (an import, remade in place when its
    source or importer changes), every other build of it, which its older files made. Each
    would otherwise leave a copy of the weights behind (737 MB for Llama-3.2-1B). A folder of
    the user's keeps the builds of other checkpoints that share its name. A build another
    process holds the lock of is left alone. The lock files of removed builds go with them, as
    do those of builds that no longer exist."""
    pattern = re.compile(re.escape(f"q4nx-{folder_name}-") + "[0-9a-f]{16}")
    freed, removed = 0, 0
    for name in MODELS.names(pattern):
        if name == current:
            continue
        if not MODELS.path(name).exists():
            MODELS.remove(name)                # only its lock file is left
            continue
        old = MODELS.source_of(name)
        if old is None:
            continue
        if not owned and (old.get("checkpoint") != source["checkpoint"]
                          or not _same_gguf(old.get("gguf"), source.get("gguf"))):
            continue
        size = MODELS.remove(name)
        if size is not None:
            freed, removed = freed + size, removed + 1
    if removed:
        log(f"[quant] removed {removed} older Q4NX build{'s' if removed > 1 else ''} of {folder_name} "
            f"({freed / 1e9:.2f} GB)")


def _same_gguf(old, new) -> bool:
    """Whether a build's GGUF stamp names the file this one was made from: the same name and
    size, whatever the third field says (another version of the package, or the file's
    modification time, which older builds were stamped with)."""
    if old is None or new is None:
        return old is new
    return isinstance(old, list) and old[:2] == new[:2]


def load_q4nx(folder: Path, gguf: GGUFOrigin | None, bf16: LlamaWeights,
              log: Callable[[str], None] = print) -> LlamaWeights:
    """`bf16` (the weights of `folder`, imported from `gguf` if from any) with its linear
    weights and LM head in Q4NX (uint8 tensors of their bytes), but for the weights the build
    kept wide (bf16 [out, in], `LlamaWeights.wide`)."""
    cfg = bf16.config
    ckpt = Checkpoint(ensure_q4nx(folder, gguf, bf16, log))
    shapes = layer_shapes(cfg)
    layers = []
    for i, lw in enumerate(bf16.layers):
        fields = lw.by_name()
        for short in linear_names(cfg):
            name = layer_tensor(i, short)
            wide = ckpt.dtype_of(name) == "BF16"
            fields[short] = ckpt.get_raw(name, shapes[short] if wide else (q4nx.nbytes(*shapes[short]),))
        layers.append(LayerWeights(**fields))
    head = ckpt.get_raw(LM_HEAD, (q4nx.nbytes(lm_head_rows(cfg), cfg.hidden_size),))
    linear = [getattr(l, s) for l in layers for s in linear_names(cfg)]
    if head.dtype != torch.uint8 or any(t.dtype not in (torch.uint8, torch.bfloat16) for t in linear):
        raise CheckpointError(f"{ckpt.folder}: Q4NX tensors must be U8 (or BF16 for a weight kept wide)")
    return LlamaWeights(cfg, bf16.embed, bf16.final_norm, head, layers, f"{bf16.source} (q4nx)", ckpt, quant=q4nx.NAME,
                        backing=bf16)
