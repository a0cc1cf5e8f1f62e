"""QUANT=q4nx weights: the on-disk cache (made once, reused, rebuilt when stale or damaged), the
GGUF path that keeps the embedded model's 4-bit values, and what the loaded model holds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llama_base import q4nx
from llama_base.errors import CheckpointError, UserError
from llama_base.paths import ENV_CACHE
from llama_runtime.checkpoints import builtin, store
from llama_runtime.checkpoints import q4nx_weights
from llama_runtime.checkpoints.loader import load_weights
from llama_runtime.checkpoints.writer import write_configs, write_sharded
from llama_runtime.checkpoints.builtin import _random_tensors


@pytest.fixture
def tiny_folder(tmp_path, monkeypatch, tiny_config):
    """A random checkpoint of tests' TINY config, with the runtime's caches in tmp_path."""
    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    tensors = _random_tensors(tiny_config, 3)
    write_sharded(folder, tensors, [list(tensors)])
    write_configs(folder, tiny_config)
    return folder


def _quiet(_msg: str) -> None:
    pass


def test_q4nx_weights_are_made_once_and_hold_every_linear_weight_and_the_head(tiny_folder, tiny_config):
    lines: list[str] = []
    w = load_weights(tiny_folder, "q4nx", lines.append)
    assert w.quant == q4nx.NAME and any("making Q4NX weights" in l for l in lines)
    bf16 = load_weights(tiny_folder)
    for i, (lq, lb) in enumerate(zip(w.layers, bf16.layers)):
        for short in q4nx_weights.linear_names(tiny_config):
            t, ref = getattr(lq, short), getattr(lb, short)
            assert t.dtype == torch.uint8 and t.numel() == q4nx.nbytes(*ref.shape)
            err = (q4nx.dequantize(t, *ref.shape).float() - ref.float()).abs().max()
            assert err < ref.float().abs().max() / 8       # 4 bits: a coarse but faithful copy
        assert torch.equal(lq.attn_norm, lb.attn_norm) and torch.equal(lq.ffn_norm, lb.ffn_norm)
    assert torch.equal(w.embed, bf16.embed)                # the embedding stays bf16
    rows = q4nx_weights.lm_head_rows(tiny_config)
    assert rows % q4nx.ROWS == 0 and rows >= tiny_config.vocab_size
    head = q4nx.dequantize(w.lm_head, rows, tiny_config.hidden_size)
    assert not head[tiny_config.vocab_size:].any()
    made = (w.checkpoint.folder / q4nx_weights.WEIGHTS_FILE).stat().st_mtime_ns
    again: list[str] = []
    w2 = load_weights(tiny_folder, "q4nx", again.append)
    assert again == [] and w2.checkpoint.folder == w.checkpoint.folder
    assert (w2.checkpoint.folder / q4nx_weights.WEIGHTS_FILE).stat().st_mtime_ns == made


def test_a_damaged_cache_is_rebuilt_and_a_changed_checkpoint_gets_a_new_entry(tiny_folder, tiny_config):
    w = load_weights(tiny_folder, "q4nx", _quiet)
    entry = w.checkpoint.folder
    data = (entry / q4nx_weights.WEIGHTS_FILE).read_bytes()
    del w
    damaged = bytearray(data)
    damaged[-1] ^= 0xFF                                    # same size: only the hash can tell
    (entry / q4nx_weights.WEIGHTS_FILE).write_bytes(bytes(damaged))
    lines: list[str] = []
    w = load_weights(tiny_folder, "q4nx", lines.append)
    assert any("does not match its hash" in l for l in lines)
    assert (w.checkpoint.folder / q4nx_weights.WEIGHTS_FILE).read_bytes() == data
    del w                                                  # (its mapping of the file goes first)
    with open(entry / q4nx_weights.WEIGHTS_FILE, "r+b") as f:
        f.truncate(len(data) // 2)                         # cut short: the stamp's size tells
    lines.clear()
    w = load_weights(tiny_folder, "q4nx", lines.append)
    assert any("is incomplete" in l and "rebuilding" in l for l in lines)
    assert not any("making Q4NX weights" in l for l in lines)
    assert (w.checkpoint.folder / q4nx_weights.WEIGHTS_FILE).read_bytes() == data
    tensors = _random_tensors(tiny_config, 4)              # new weights, same names and shapes
    write_sharded(tiny_folder, tensors, [list(tensors)])
    w2 = load_weights(tiny_folder, "q4nx", _quiet)
    assert w2.checkpoint.folder != w.checkpoint.folder


def test_the_digest_covers_every_piece_and_the_length(tmp_path, monkeypatch):
    """Pieces hashed side by side, combined in file order: the digest is the SHA-256 of the
    pieces' SHA-256s, and a byte changed in any piece, or a byte cut off, changes it."""
    import hashlib

    monkeypatch.setattr(q4nx_weights, "PIECE_BYTES", 1000)
    monkeypatch.setattr(q4nx_weights, "READ_BYTES", 384)     # reads that straddle the pieces
    data = bytes(np.random.default_rng(1).integers(0, 256, 4500, dtype=np.uint8))
    f = tmp_path / "w.bin"
    f.write_bytes(data)
    pieces = b"".join(hashlib.sha256(data[i:i + 1000]).digest() for i in range(0, len(data), 1000))
    digest = q4nx_weights._digest(f)
    assert digest == f"{q4nx_weights.DIGEST_SCHEME}:{hashlib.sha256(pieces).hexdigest()}"
    seen = {digest}
    for at in (0, 999, 1000, 2500, 4499):
        changed = bytearray(data)
        changed[at] ^= 1
        f.write_bytes(bytes(changed))
        seen.add(q4nx_weights._digest(f))
    f.write_bytes(data[:-1])
    seen.add(q4nx_weights._digest(f))
    assert len(seen) == 7


def test_a_new_build_removes_the_builds_of_older_code_for_the_same_checkpoint(tiny_folder):
    """A quantizer update makes a new cache entry; the one it replaces goes, and nothing else."""
    import json
    import shutil

    entry = load_weights(tiny_folder, "q4nx", _quiet).checkpoint.folder
    root, prefix = entry.parent, f"q4nx-{tiny_folder.name}-"

    def copy(name: str, edit) -> None:
        shutil.copytree(entry, root / name)
        stamp_path = root / name / store.STAMP_FILE
        stamp = json.loads(stamp_path.read_text())
        edit(stamp["source"])
        stamp_path.write_text(json.dumps(stamp))

    copy(prefix + "0" * 16, lambda src: src.update(code="older"))                 # superseded
    copy(prefix + "3" * 16, lambda src: src.update(code="older"))                 # superseded, in use
    copy(prefix + "1" * 16, lambda src: src["checkpoint"]["files"].clear())       # another checkpoint
    copy(f"q4nx-{tiny_folder.name}-extra-" + "2" * 16, lambda src: src.update(code="older"))  # another name
    shutil.rmtree(entry)                                   # as if the current code had never run
    for key in "014":                                      # "4": a build that no longer exists
        (root / f".{prefix}{key * 16}.lock").touch()
    lines: list[str] = []
    with store.MODELS.lock(prefix + "3" * 16):
        again = load_weights(tiny_folder, "q4nx", lines.append).checkpoint.folder
    assert again == entry and any("removed 1 older Q4NX build of" in l for l in lines)
    locks = {p.name for p in root.glob(f".{prefix}*.lock")}
    assert locks == {f".{prefix}{key * 16}.lock" for key in "13"} | {f".{entry.name}.lock"}
    left = sorted(p.name for p in root.iterdir() if p.name.startswith("q4nx-"))
    assert left == sorted([entry.name, prefix + "1" * 16, prefix + "3" * 16,
                           f"q4nx-{tiny_folder.name}-extra-" + "2" * 16])
    lines.clear()
    load_weights(tiny_folder, "q4nx", lines.append)        # nothing built, nothing removed
    assert lines == [] and (root / (prefix + "3" * 16)).is_dir()


def test_an_unknown_format_lists_the_known_ones(tiny_folder):
    with pytest.raises(UserError, match="expected one of bf16, q4nx"):
        load_weights(tiny_folder, "q3")


def test_a_reinstalled_gguf_reuses_the_cache_and_builds_from_other_installs_are_replaced(tmp_path, monkeypatch):
    """Every new environment installs the embedded model's GGUF afresh, with a new modification
    time: its Q4NX weights stay the same entry. A package upgrade builds a new one, which
    replaces the builds made from other installs, including those stamped with the file's time,
    and those made from the import's older files (the model cache remakes its imports in place)."""
    import json
    import os
    import shutil

    from llama_base.paths import models_dir
    from llama_runtime.checkpoints.gguf import importer

    shared = builtin.ensure_embedded_model()           # imported once for the suite, then copied
    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    shutil.copytree(shared, models_dir() / shared.name)
    packaged = importer.smollm2_gguf_path()
    installs = []
    for i, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        installs.append(shutil.copy(packaged, tmp_path / name / packaged.name))
        os.utime(installs[-1], ns=(10**18 + i, 10**18 + i))
    monkeypatch.setattr(importer, "smollm2_gguf_path", lambda: installs[0])
    folder = builtin.ensure_embedded_model()
    entry = load_weights(folder, "q4nx", _quiet).checkpoint.folder
    monkeypatch.setattr(importer, "smollm2_gguf_path", lambda: installs[1])
    lines: list[str] = []
    assert load_weights(folder, "q4nx", lines.append).checkpoint.folder == entry and lines == []

    other = entry.parent / f"q4nx-{folder.name}-{'0' * 16}"
    shutil.copytree(entry, other)
    stamp = json.loads((other / store.STAMP_FILE).read_text())
    stamp["source"]["gguf"][2] = 10**18 - 7                 # stamped with an install's time
    stamp["source"]["code"] = "older"
    (other / store.STAMP_FILE).write_text(json.dumps(stamp))
    reimported = entry.parent / f"q4nx-{folder.name}-{'1' * 16}"     # made from the folder's older files
    shutil.copytree(entry, reimported)
    stamp["source"]["checkpoint"]["files"].clear()
    (reimported / store.STAMP_FILE).write_text(json.dumps(stamp))
    monkeypatch.setattr(importer, "smollm2_version", lambda: "99.0")   # the package upgraded
    upgraded = load_weights(folder, "q4nx", lines.append).checkpoint.folder
    assert upgraded != entry and any("removed 3 older Q4NX builds of" in l for l in lines)
    assert not entry.exists() and not other.exists() and not reimported.exists()


@pytest.fixture(scope="module")
def embedded_q4nx():
    folder = builtin.ensure_embedded_model()
    return folder, load_weights(folder, "q4nx", _quiet)


def test_the_embedded_model_keeps_its_gguf_4_bit_values(embedded_q4nx):
    """The GGUF's Q4_1 nibbles, rows un-permuted for half-split RoPE, are the Q4NX values."""
    from gguf import GGUFReader

    from llama_runtime.checkpoints import quantize
    from llama_runtime.checkpoints.gguf.importer import smollm2_gguf_path, unpermute_rope_rows

    folder, w = embedded_q4nx
    cfg = w.config
    tensors = {t.name: t for t in GGUFReader(smollm2_gguf_path()).tensors}
    for gguf_name, short, heads in [("blk.3.ffn_down.weight", "w_down", None),
                                    ("blk.0.attn_q.weight", "wq", cfg.num_attention_heads),
                                    ("blk.7.attn_k.weight", "wk", cfg.num_key_value_heads)]:
        t = tensors[gguf_name]
        n, k = getattr(w.backing.layers[0], short).shape
        q, d, m = quantize.q4_1_fields(t.data, n, k)
        if heads:
            q, d = unpermute_rope_rows(q, heads), unpermute_rope_rows(d, heads)
        layer = int(gguf_name.split(".")[1])
        q2, s2, _ = q4nx.unpack(getattr(w.layers[layer], short), n, k)
        assert torch.equal(q2, q)
        assert torch.equal(s2, d.to(torch.bfloat16))


def test_the_embedded_q4nx_weights_equal_its_bf16_import_up_to_the_scale_rounding(embedded_q4nx):
    """The bf16 import is the GGUF dequantized; the Q4NX weights differ from it only by the
    fp16 -> bf16 rounding of scales and mins (and the dequantized weight's own bf16 rounding)."""
    _, w = embedded_q4nx
    for short in ("wq", "w_gate", "w_down"):
        ref = getattr(w.backing.layers[5], short).float()
        got = q4nx.dequantize(getattr(w.layers[5], short), *ref.shape).float()
        assert (got - ref).abs().max() <= ref.abs().max() * 2 ** -6


def test_a_gguf_type_q4nx_cannot_hold_is_named(tmp_path, monkeypatch, tiny_config):
    """A GGUF whose linear weight is IQ4_NL (4 bits, but indices into a non-linear table of
    levels, not an affine q * scale + min): one error naming the tensor and its type."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "bad.gguf"
    wr = GGUFWriter(str(path), "llama")
    h = tiny_config.hidden_size
    iq4_nl_bytes = 18                                      # per block of 32: fp16 d, 16 bytes of 4-bit indices
    wr.add_tensor("blk.0.ffn_up.weight", np.zeros((tiny_config.intermediate_size, h // 32 * iq4_nl_bytes), np.uint8),
                  raw_dtype=GGMLQuantizationType.IQ4_NL)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(CheckpointError, match="'blk.0.ffn_up.weight' is IQ4_NL"):
        q4nx_weights._gguf_tensors(path, tiny_config)
