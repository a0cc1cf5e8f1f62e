"""A user's GGUF file as MODEL: imported once into the model cache, its Llama 3 RoPE scaling
recovered from llama.cpp's divisors, its Q4_0 / Q4_1 / Q4_K values kept by QUANT=q4nx and its
wider linear tensors kept in bf16 (the layers holding them run group variants), and a type
Q4NX cannot hold refused, in one line, before anything is imported."""
from __future__ import annotations

import math
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from q4nx_twin import dequantized_model

from llama32_1b_inference import main as run_cli
from llama_base import q4nx
from llama_base.config import LlamaConfig, RopeScaling
from llama_base.errors import CheckpointError
from llama_base.paths import ENV_CACHE, models_dir
from llama_runtime.checkpoints import builtin
from llama_runtime.checkpoints import quantize
from llama_runtime.checkpoints.loader import load_weights
from llama_runtime.checkpoints.gguf.importer import rope_heads, rope_scaling_of, unpermute_rope_rows
from llama_runtime.checkpoints.resolve import resolve_checkpoint

# A Llama 3.2 scaling other than the defaults, so the recovered parameters are not a fallback.
SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=2048)
GGUF_LAYER = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
              "w_up": "ffn_up", "w_down": "ffn_down", "attn_norm": "attn_norm", "ffn_norm": "ffn_norm"}


def _gguf_types():
    from gguf import GGMLQuantizationType as T

    # Every branch of the Q4NX import: 4-bit values kept (Q4_0, Q4_1, Q4_K; rows permuted or not),
    # wider types kept in bf16 (Q8_0, F16), as the file holds 4-bit ones too.
    return {"wq": T.Q4_0, "wk": T.Q4_1, "wv": T.Q4_K, "wo": T.Q8_0, "w_gate": T.Q4_1, "w_up": T.Q4_K,
            "w_down": T.F16}


def q4_k_bytes(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q4_K super-blocks of random nibbles and 6-bit scales and mins under small fp16 d and
    dmin (gguf-py has no Q4_K quantizer; any such bytes are a valid tensor)."""
    from llama_runtime.checkpoints.quantize import Q4_K_BYTES, Q4_K_WEIGHTS

    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // Q4_K_WEIGHTS, Q4_K_BYTES), dtype=np.uint8)
    for lo, scale in ((0, 2e-3), (2, 1e-2)):          # d, then dmin
        b[..., lo:lo + 2] = (rng.random(b.shape[:2]) * scale).astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(rows, -1)


def llama_cpp_divisors(base: float, head_dim: int, rs: RopeScaling) -> np.ndarray:
    """`rope_freqs.weight` as llama.cpp's converter computes it for a Llama 3 config: the rule
    written out here from its description, not taken from the importer."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < rs.original_max_position_embeddings / rs.high_freq_factor:
            out.append(1.0)
        elif wavelen > rs.original_max_position_embeddings / rs.low_freq_factor:
            out.append(rs.factor)
        else:
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor)
            out.append(1 / ((1 - smooth) / rs.factor + smooth))
    return np.array(out, dtype=np.float32)


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order for a Q/K weight: the inverse of `unpermute_rope_rows`."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.fixture(scope="module")
def source():
    """The tiny model's config and weights, and the embedded GGUF's tokenizer metadata."""
    from gguf import GGUFReader

    from llama_runtime.checkpoints.gguf.importer import smollm2_gguf_path
    from llama_runtime.checkpoints.weights import synthetic_weights

    cfg = replace(builtin.tiny_config(builtin.ensure_embedded_model()), rope_scaling=SCALING)
    reader = GGUFReader(smollm2_gguf_path())
    tokenizer = [(name, f.contents(), f.types) for name, f in reader.fields.items() if name.startswith("tokenizer.")]
    return cfg, synthetic_weights(cfg, seed=7), tokenizer


def write_gguf(path, source, types=None, raw=None, layer_types=None):
    """A llama GGUF of `source` as llama.cpp lays one out; `types` by short name (`layer_types`
    {layer: {short name: type}} for some layers only), `raw` {gguf name: (bytes array, type)}
    replacing a tensor with bytes of a type gguf cannot write."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import quantize as gguf_quantize

    cfg, weights, tokenizer = source
    types = {**_gguf_types(), **(types or {})}
    wr = GGUFWriter(str(path), "llama")
    wr.add_block_count(cfg.num_hidden_layers)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_attention_heads)
    wr.add_head_count_kv(cfg.num_key_value_heads)
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    wr.add_rope_freq_base(cfg.rope_theta)
    wr.add_rope_dimension_count(cfg.head_dim)
    wr.add_vocab_size(cfg.vocab_size)
    for name, value, vtypes in tokenizer:
        wr.add_key_value(name, value, vtypes[0], sub_type=vtypes[-1] if len(vtypes) > 1 else None)

    def add(name, t: torch.Tensor, kind):
        if name in (raw or {}):
            data, kind = raw[name]
            wr.add_tensor(name, data, raw_dtype=kind)
        elif kind == T.Q4_K:
            wr.add_tensor(name, q4_k_bytes(*t.shape, seed=len(name)), raw_dtype=kind)
        elif kind in (T.F32, T.F16):
            wr.add_tensor(name, t.float().numpy().astype(np.float32 if kind == T.F32 else np.float16))
        else:
            wr.add_tensor(name, gguf_quantize(t.float().numpy(), kind), raw_dtype=kind)

    add("token_embd.weight", weights.embed, T.F16)
    for i, lw in enumerate(weights.layers):
        for short, t in lw.by_name().items():
            heads = rope_heads(short, cfg)
            kind = (layer_types or {}).get(i, {}).get(short, types.get(short, T.F32))
            add(f"blk.{i}.{GGUF_LAYER[short]}.weight", _permute(t, heads) if heads else t, kind)
    add("output_norm.weight", weights.final_norm, T.F32)
    wr.add_tensor("rope_freqs.weight", llama_cpp_divisors(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.fixture(scope="module")
def imported(source, tmp_path_factory):
    """The tiny model's GGUF, imported once into a cache of the module's own: (path, folder,
    the import's log lines)."""
    root = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as m:
        m.setenv(ENV_CACHE, str(root / "cache"))
        path = write_gguf(root / "my model.gguf", source)
        lines: list[str] = []
        yield path, resolve_checkpoint(str(path), lines.append).folder, lines


def _imports():
    return sorted(p.name for p in models_dir().glob(f"{builtin.GGUF_DIR_PREFIX}*"))


def _model_cache():
    """Everything in the model cache, hidden lock files included."""
    return sorted(p.name for p in models_dir().iterdir()) if models_dir().exists() else []


def test_a_gguf_file_is_imported_once_with_its_config_and_dequantized_values(source, imported):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    cfg = source[0]
    path, folder, lines = imported
    assert _imports() == [folder.name] and lines == [f"[model] importing my model.gguf (once; cached in {folder})"]
    w = load_weights(str(path))
    assert w.config == cfg                      # RoPE scaling recovered from the divisors, eos, shapes
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for short in ("wq", "wk", "w_gate", "w_down"):
        t = tensors[f"blk.1.{GGUF_LAYER[short]}.weight"]
        want = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        heads = rope_heads(short, cfg)
        want = unpermute_rope_rows(want, heads) if heads else want
        assert torch.equal(getattr(w.layers[1], short), want.to(torch.bfloat16)), short
    again: list[str] = []
    assert resolve_checkpoint(str(path), again.append).folder == folder and again == []     # cached


def test_q4nx_keeps_the_files_4_bit_values(source, imported):
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    cfg = source[0]
    path = imported[0]
    w = load_weights(str(path), "q4nx", lambda _: None)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for short, kind in _gguf_types().items():
        n, k = w.backing.layers[0].by_name()[short].shape
        if kind not in (T.Q4_0, T.Q4_1, T.Q4_K):   # wider types: their values, in bf16
            assert torch.equal(getattr(w.layers[0], short), getattr(w.backing.layers[0], short)), short
            continue
        q2, s2, _ = q4nx.unpack(getattr(w.layers[0], short), n, k)
        t = tensors[f"blk.0.{GGUF_LAYER[short]}.weight"]
        fields = {T.Q4_0: quantize.q4_0_fields, T.Q4_1: quantize.q4_1_fields, T.Q4_K: quantize.q4_k_fields}[kind]
        q, d, _ = fields(t.data, n, k)
        heads = rope_heads(short, cfg)
        if heads:
            q, d = unpermute_rope_rows(q, heads), unpermute_rope_rows(d, heads)
        assert torch.equal(q2, q), short
        assert torch.equal(s2, d.to(torch.bfloat16)), short


def test_a_4_bit_files_wider_tensors_stay_bf16_in_the_layers_holding_them(source, tmp_path, monkeypatch, capsys):
    """As llama.cpp's Q4_K_M gives some layers' V and down projections 6 bits: under QUANT=q4nx
    those weights keep their values in bf16, their layer runs group variants with a bf16 GEMV
    (decode) and GEMM (prefill) for them, the other layers the all-Q4NX groups, and the logits
    are a bf16 model's on the same weights (the 4-bit ones dequantized)."""
    from gguf import GGMLQuantizationType as T

    from llama_runtime.cli.compile import main as compile_cli
    from llama_runtime.engine.decode import decode_step
    from llama_runtime.engine.prefill import prefill
    from llama_runtime.checkpoints.q4nx_weights import wide_sets
    from llama_runtime.generation.session import build_session
    from verify.__main__ import main as verify_cli
    from verify.hf_runner import HFRunner
    from verify.mlir import main as verify_mlir

    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    cfg = source[0]
    four_bit = dict.fromkeys(("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"), T.Q4_0)
    path = write_gguf(tmp_path / "k_m.gguf", source, types=four_bit,
                      layer_types={0: {"wv": T.Q8_0, "w_down": T.Q5_0}})
    lines: list[str] = []
    w = load_weights(str(path), "q4nx", lines.append)
    layers = cfg.num_hidden_layers
    assert [w.wide(i) for i in range(layers)] == [{"wv", "w_down"}] + [set()] * (layers - 1)
    kept = sum(2 * getattr(w.backing.layers[0], short).numel() for short in ("wv", "w_down"))
    share = kept / os.path.getsize(w.checkpoint.folder / "weights.safetensors")
    said = f"2 linear weights of a wider type in k_m.gguf kept in bf16 ({kept / 1e6:.0f} MB, {share:.0%} of the build)"
    assert said in "\n".join(lines)
    for short in ("wv", "w_down"):       # the file's values, as the bf16 import holds them
        assert torch.equal(getattr(w.layers[0], short), getattr(w.backing.layers[0], short)), short

    session = build_session(str(path), "sim", max_context=256, cache_dir=tmp_path / "kernels", buckets=(32, 64), decode="layers",
                            log=lambda _: None, quant="q4nx")
    model = session.model
    assert model.decode_groups[0]["rms_gemv_rope"].name == "rms_gemv_rope_q4nx_bf16_wv"
    assert model.decode_groups[0]["o_gemv_ffn"].name == "o_gemv_ffn_q4nx_bf16_w_down"
    assert model.prefill_groups[64][0].o_ffn.name == "o_ffn_s64_q4nx_bf16_w_down"
    assert model.decode_groups[1]["o_gemv_ffn"].name == "o_gemv_ffn_q4nx"
    down = next(l for l in model.prefill_groups[64][0].o_ffn.launches if l.name == "down_proj")
    assert down.op == "gemm" and model.prefill_groups[64][1].o_ffn.launches[-2].op == "gemm_q4nx"
    # each weight resident once in its own format, the phases sharing its BO
    linear = sum(t.numel() * t.element_size() for lw in w.layers for t in lw.by_name().values())
    assert model.kc.resident_bytes()["static"] == linear + w.lm_head.numel()

    model.rescore_k = 0                  # the device's logits, as the bf16 model's head computes them
    reference = dequantized_model(session)
    ids = session.encode("What is the capital of Japan?")
    ours, want = prefill(model, ids), prefill(reference, ids)
    assert int(ours.argmax()) == int(want.argmax())
    assert torch.nn.functional.cosine_similarity(ours, want, dim=0) > 0.999
    tok = int(ours.argmax())
    ours, want = decode_step(model, tok, len(ids)), decode_step(reference, tok, len(ids))
    assert int(ours.argmax()) == int(want.argmax())
    assert torch.nn.functional.cosine_similarity(ours, want, dim=0) > 0.995

    # `make compile` finds the same variants from the file's header alone
    assert wide_sets(session.resolved.gguf, cfg) == w.wide_sets() == ({"wv", "w_down"}, frozenset())
    assert compile_cli(["--model", str(path), "--quant", "q4nx", "--device", "sim", "--max-seq", "64"]) == 0
    printed = capsys.readouterr().out
    for name in ("rms_gemv_rope_q4nx_bf16_wv", "o_ffn_s64_q4nx_bf16_w_down", "o_ffn_s64_q4nx"):
        assert f"[compile] {name}: " in printed, name
    # `make verify-mlir` interprets them, on the model's weights and on synthetic ones
    assert verify_mlir(["--model", str(path), "--quant", "q4nx", "--max-seq", "32", "--n-tokens", "0"]) == 0
    rows = [line.split("  ")[0] for line in capsys.readouterr().out.splitlines()]
    assert {"o_gemv_ffn_q4nx_bf16_w_down", "rms_gemms_rope_s32_q4nx_bf16_wv", "o_gemv_ffn_q4nx"} <= set(rows)
    # `make verify QUANT=q4nx`'s HF side multiplies the same numbers: kept weights as stored
    hf_layers = HFRunner(session.resolved.folder, w.checkpoint.folder).model.model.layers
    assert torch.equal(hf_layers[0].self_attn.v_proj.weight, w.layers[0].wv)
    assert torch.equal(hf_layers[0].mlp.down_proj.weight, w.layers[0].w_down)
    assert torch.equal(hf_layers[1].mlp.down_proj.weight,
                       q4nx.dequantize(w.layers[1].w_down, cfg.hidden_size, cfg.intermediate_size))
    monkeypatch.setenv("LLAMA_NPU_REPORTS", str(tmp_path / "reports"))
    assert verify_cli(["--model", str(path), "--quant", "q4nx", "--device", "sim", "--prompts", "1",
                       "--n-tokens", "8"]) == 0


def test_a_changed_file_is_imported_again_into_the_same_folder(imported):
    path, folder, _ = imported
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))        # the file replaced
    lines: list[str] = []
    assert resolve_checkpoint(str(path), lines.append).folder == folder and len(lines) == 1
    assert _imports() == [folder.name]


def test_an_import_cut_short_is_imported_again_saying_why(imported):
    path, folder, _ = imported
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)                     # a full disk, an interrupted copy
    lines: list[str] = []
    assert resolve_checkpoint(str(path), lines.append).folder == folder
    assert len(lines) == 1 and "is incomplete" in lines[0] and "rebuilding" in lines[0], lines
    assert weights.stat().st_size == size and _imports() == [folder.name]


def test_a_type_q4nx_cannot_hold_is_refused_before_the_import(source, tmp_path, monkeypatch, capsys):
    """A Q3_K layer (as in llama.cpp's Q3_K_M files): QUANT=q4nx names it in one line, exit 2,
    and imports nothing; QUANT=bf16 runs the file from its dequantized values."""
    from gguf import GGMLQuantizationType as T

    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    cfg = source[0]
    q3_k_block = 110                                  # bytes per 256 weights: 32 of high bits, 64 of 2-bit values, 12 of scales, d
    zeros = np.zeros((cfg.intermediate_size, cfg.hidden_size // 256 * q3_k_block), np.uint8)
    path = write_gguf(tmp_path / "k.gguf", source, raw={"blk.1.ffn_up.weight": (zeros, T.Q3_K)})
    code = run_cli(["--prompt", "hi", "--model", str(path), "--quant", "q4nx", "--device", "sim", "--n-tokens", "1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert "tensor 'blk.1.ffn_up.weight' is Q3_K, which QUANT=q4nx cannot hold" in err[0]
    assert _model_cache() == []
    w = load_weights(str(path), "bf16")
    assert not w.layers[1].w_up.any()


def test_a_file_that_is_not_a_whole_gguf_is_one_line(source, tmp_path, monkeypatch, capsys):
    """Not a GGUF, one cut inside its header or its tensors, a weight of the wrong shape or one
    named twice: exit 2 with one line, and nothing in the model cache, not even a lock file."""
    from llama_runtime.checkpoints.gguf.importer import smollm2_gguf_path

    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    cfg = source[0]
    junk, cut, short = tmp_path / "junk.gguf", tmp_path / "cut.gguf", tmp_path / "short.gguf"
    junk.write_text("not a model\n")
    with open(smollm2_gguf_path(), "rb") as f:
        cut.write_bytes(f.read(1000))
    whole = write_gguf(tmp_path / "whole.gguf", source).read_bytes()
    short.write_bytes(whole[:len(whole) - 4096])
    transposed = np.zeros((cfg.hidden_size, cfg.intermediate_size), np.float32)   # [in, out], not HF's [out, in]
    wrong = write_gguf(tmp_path / "wrong.gguf", source, raw={"blk.0.ffn_gate.weight": (transposed, None)})
    twice = tmp_path / "twice.gguf"
    twice.write_bytes(whole.replace(b"blk.0.attn_q.weight", b"blk.1.attn_q.weight", 1))
    cases = ((junk, "not a readable GGUF file .*magic"), (cut, "not a readable GGUF file .*cut short"),
             (short, "not a readable GGUF file .*cut short inside tensor"),
             (wrong, "'blk.0.ffn_gate.weight' has shape \\[256, 1024\\], expected \\[1024, 256\\]"),
             (twice, "tensor 'blk.1.attn_q.weight' appears twice"))
    for path, why in cases:
        with pytest.raises(CheckpointError, match=why):
            resolve_checkpoint(str(path))
        code = run_cli(["--prompt", "hi", "--model", str(path), "--device", "sim", "--n-tokens", "1"])
        err = [line for line in capsys.readouterr().err.splitlines() if line]
        assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert _model_cache() == []


def test_a_split_part_or_a_vocabulary_transformers_cannot_rebuild_is_one_line(source, tmp_path, monkeypatch,
                                                                             capsys):
    """Both are refused before the import begins: exit 2, one line, an empty model cache."""
    from gguf import GGUFValueType

    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))
    cfg, weights, tokenizer = source
    split = [*tokenizer, ("split.count", 2, [GGUFValueType.UINT16])]
    unknown = [(n, "nonsense" if n == "tokenizer.ggml.model" else v, t) for n, v, t in tokenizer]
    cases = ((write_gguf(tmp_path / "part.gguf", (cfg, weights, split)), "one of 2 parts of a split GGUF"),
             (write_gguf(tmp_path / "vocab.gguf", (cfg, weights, unknown)), "its tokenizer cannot be rebuilt"))
    for path, why in cases:
        code = run_cli(["--prompt", "hi", "--model", str(path), "--device", "sim", "--n-tokens", "1"])
        err = [line for line in capsys.readouterr().err.splitlines() if line]
        assert code == 2 and len(err) == 1 and why in err[0], err
    assert _model_cache() == []


def test_only_llama_3_scaling_is_recovered_from_rope_divisors():
    cfg = replace(LlamaConfig(), rope_scaling=None)
    llama32 = RopeScaling()                           # Llama 3.2's: 32, 1, 4, 8192
    assert rope_scaling_of(llama_cpp_divisors(cfg.rope_theta, cfg.head_dim, llama32), cfg) == llama32
    assert rope_scaling_of(np.ones(cfg.head_dim // 2, np.float32), cfg) is None
    with pytest.raises(CheckpointError, match="not Llama 3's scaling rule"):
        rope_scaling_of(np.full(cfg.head_dim // 2, 4.0, np.float32), cfg)      # linear scaling
    with pytest.raises(CheckpointError, match="rotates 32 pairs"):
        rope_scaling_of(np.ones(8, np.float32), cfg)
