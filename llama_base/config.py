"""The model's description: the subset of a HF `config.json` the project computes with, and the
names and shapes of one layer's tensors.

Everything shape-related (kernel-group slot shapes, bucket sizes, the KV cache, token ids) is
read from a `LlamaConfig`, never written as a literal elsewhere, so the same code runs
Llama-3.2-1B, a 3B-shaped config and the embedded SmolLM2 model. It sits below every other
package because the build side (group declarations) and the run side (weights, KV cache)
both start from it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from llama_base.errors import CheckpointError


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (rope_type "llama3"); `None` on a LlamaConfig means plain RoPE."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    """The subset of a HF `config.json` the runtime computes with. Defaults are Llama-3.2-1B."""

    hidden_size: int = 2048
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 8192
    vocab_size: int = 128256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    bos_token_id: int = 128000
    eos_token_ids: tuple[int, ...] = (128001, 128008, 128009)

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, cfg: dict) -> "LlamaConfig":
        arch = cfg.get("architectures") or ["LlamaForCausalLM"]
        if cfg.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in arch:
            raise CheckpointError(
                f"unsupported architecture {arch} (model_type {cfg.get('model_type')!r}); "
                "only LlamaForCausalLM checkpoints are supported"
            )
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise CheckpointError("unsupported Llama variant: needs silu activation and no attention/MLP bias")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            rope = cfg.get("rope_parameters") or {}
            # transformers 5 nests RoPE settings in rope_parameters; older configs keep them top-level.
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            scaling = rope if rope.get("rope_type") else (cfg.get("rope_scaling") or {})
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype == "llama3":
                rs: RopeScaling | None = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                )
            elif rtype == "default":
                rs = None
            else:
                raise CheckpointError(f"unsupported rope type {rtype!r} (supported: default, llama3)")
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
                hidden_size=hidden,
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rs,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=int(cfg["bos_token_id"]) if cfg.get("bos_token_id") is not None else -1,
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json is missing {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "LlamaConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: config.json not found")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None

    def to_dict(self) -> dict:
        """A HF-style config.json for this configuration (used to write test checkpoints)."""
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "bfloat16",
            "initializer_range": 0.02,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **{f.name: getattr(self.rope_scaling, f.name)
                                                           for f in fields(RopeScaling)}}
        return d


def layer_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF layout: linear weights are [out_features, in_features]."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    return {
        "attn_norm": (h,), "wq": (cfg.q_dim, h), "wk": (cfg.kv_dim, h), "wv": (cfg.kv_dim, h),
        "wo": (h, cfg.q_dim), "ffn_norm": (h,), "w_gate": (f, h), "w_up": (f, h), "w_down": (h, f),
    }


# The family's published configurations (their config.json files), for the shape checkpoints,
# the hardware-rule tests and the cost model; one spelling of each.
LLAMA_3_2_1B = LlamaConfig()
LLAMA_3_2_3B = LlamaConfig(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                           head_dim=128, intermediate_size=8192)
LLAMA_3_1_8B = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                           rope_scaling=RopeScaling(factor=8.0))
