"""Config parsing for the supported shapes, and the RoPE table against transformers' rotary embedding."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kernel_builder.groups import all_groups, prefill_buckets
from llama_base.config import LlamaConfig, RopeScaling
from llama_base.errors import CheckpointError
from llama_base.rope import generate_rope_lut

LLAMA_1B = {  # Llama-3.2-1B-Instruct's config.json as published (transformers 4 layout)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
    "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
LLAMA_3B = {**LLAMA_1B, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128}
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}


def test_llama_1b_config_is_the_default():
    assert LlamaConfig.from_dict(LLAMA_1B) == LlamaConfig()


def test_transformers_5_rope_parameters_layout_parses_the_same():
    v5 = {k: v for k, v in LLAMA_1B.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA_1B["rope_scaling"]}
    assert LlamaConfig.from_dict(v5) == LlamaConfig()


def test_3b_and_smollm2_shapes():
    c3 = LlamaConfig.from_dict(LLAMA_3B)
    assert (c3.hidden_size, c3.num_hidden_layers, c3.head_dim, c3.q_dim, c3.kv_dim, c3.gqa_group) == \
        (3072, 28, 128, 3072, 1024, 3)
    s = LlamaConfig.from_dict(SMOLLM2)
    assert (s.head_dim, s.kv_dim, s.rope_scaling, s.eos_token_ids, s.tie_word_embeddings) == (64, 192, None, (2,), True)
    for cfg in (c3, s):              # every group declares legal shapes for these configs
        buckets = prefill_buckets(cfg, 256)
        assert buckets[-1] == 256 and len(all_groups(cfg, buckets)) == 3 * len(buckets) + 3


def test_bad_configs_are_one_line_errors():
    with pytest.raises(CheckpointError, match="missing 'hidden_size'"):
        LlamaConfig.from_dict({k: v for k, v in LLAMA_1B.items() if k != "hidden_size"})
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        LlamaConfig.from_dict({**LLAMA_1B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("cfg_dict", [LLAMA_1B, SMOLLM2], ids=["llama3-scaled", "plain"])
def test_rope_table_matches_transformers(cfg_dict):
    cfg = LlamaConfig.from_dict(cfg_dict)
    positions = torch.tensor([[0, 1, 1000, 8191]])
    rot = LlamaRotaryEmbedding(config=HFLlamaConfig(**cfg_dict))
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), positions)
    lut = generate_rope_lut(cfg, 8192)[positions[0]]
    h = cfg.head_dim // 2
    assert torch.equal(lut[:, :h], cos[0, :, :h].to(torch.bfloat16))
    assert torch.equal(lut[:, h:], sin[0, :, :h].to(torch.bfloat16))
    if cfg.rope_scaling == RopeScaling():         # the scaling really changed the low frequencies
        unscaled = generate_rope_lut(LlamaConfig(rope_scaling=None), 8192)[positions[0]]
        assert not torch.equal(unscaled, lut)


def test_a_safetensors_file_written_one_tensor_at_a_time_reads_back_in_every_reader(tmp_path):
    """`write_streaming` (the GGUF import's and the Q4NX build's writer) against safetensors' own
    reader and ours; a tensor other than the one announced next is refused."""
    from safetensors import safe_open

    from llama_runtime.checkpoints.writer import write_streaming
    from llama_runtime.checkpoints.safetensors_io import SafetensorsFile

    tensors = {"b.weight": torch.randn(3, 5).to(torch.bfloat16), "a.bytes": torch.arange(7, dtype=torch.uint8),
               "c.f32": torch.randn(2, 2, 3)}
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "x.safetensors"
    write_streaming(path, specs, iter(tensors.items()), {"format": "pt"})
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(tensors)
        for n, t in tensors.items():
            assert torch.equal(f.get_tensor(n), t)
    ours = SafetensorsFile(path)
    assert all(torch.equal(ours.tensor(n), t) for n, t in tensors.items())
    items = list(tensors.items())
    wrong = {"order": items[::-1], "shape": [("b.weight", torch.zeros(5, 3, dtype=torch.bfloat16)), *items[1:]],
             "dtype": [("b.weight", tensors["b.weight"].float()), *items[1:]], "missing": items[:2],
             "extra": [*items, ("d", torch.zeros(1))]}
    for why, given in wrong.items():
        with pytest.raises(ValueError, match="expected|more tensors"):
            write_streaming(tmp_path / f"{why}.safetensors", specs, iter(given), {})


@pytest.mark.parametrize("tied", [True, False])
def test_the_tensor_names_are_transformers_own(tied):
    """Every name a checkpoint is read and written by is the one HF transformers' Llama gives
    its weights, each once, with the shape `layer_shapes` expects."""
    from transformers import LlamaForCausalLM

    from llama_base.config import layer_shapes
    from llama_base.tensor_names import parse_layer_tensor, tensor_names

    hf = HFLlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=96, tie_word_embeddings=tied)
    state = LlamaForCausalLM(hf).state_dict()
    if tied:
        state.pop("lm_head.weight")       # a tied head is the embedding's tensor, saved once
    names = tensor_names(2, tied)
    assert sorted(names) == sorted(state) and len(set(names)) == len(names)
    cfg = LlamaConfig.from_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    for name, t in state.items():
        parsed = parse_layer_tensor(name)
        if parsed is not None:
            assert tuple(t.shape) == layer_shapes(cfg)[parsed[1]], name
    assert parse_layer_tensor("model.layers.1.mlp.up_proj.weight") == (1, "w_up")
    assert parse_layer_tensor("model.layers.1.mlp.up_proj.bias") is None
