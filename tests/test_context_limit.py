"""The context a run asks for (MAX_CONTEXT, `--max-context`): up to the model's own limit, and
only where its KV cache fits in the memory the machine has; anything else is one line, exit 2,
before a weight is read."""
from __future__ import annotations

from collections import namedtuple

import pytest

from llama_base.config import LlamaConfig
from llama_base.errors import ContextError
from llama_runtime.cli import run
from llama_runtime.engine import kv_cache
from llama_runtime.engine.kv_cache import KVCache, context_positions, kv_cache_bytes
from llama_runtime.generation import session as session_module

LLAMA_1B = LlamaConfig()


def test_the_check_prices_the_cache_the_runtime_allocates(tiny_config):
    cache = KVCache(tiny_config.num_hidden_layers, tiny_config.num_key_value_heads, 300, tiny_config.head_dim)
    assert cache.nbytes == kv_cache_bytes(tiny_config, 300)


def test_a_context_within_the_limit_is_given_and_the_default_is_capped_by_it(tiny_config):
    limit = tiny_config.max_position_embeddings
    assert context_positions(tiny_config, None, 4 * limit) == limit
    assert context_positions(tiny_config, None, limit // 4) == limit // 4
    assert context_positions(tiny_config, limit, 16) == limit
    with pytest.raises(ContextError, match=f"past this model's limit of {limit} positions"):
        context_positions(tiny_config, limit + 1, 16)
    with pytest.raises(ContextError, match="at least one position"):
        context_positions(tiny_config, 0, 16)


def test_llama_s_whole_context_is_refused_where_its_cache_cannot_fit(monkeypatch):
    """Llama-3.2-1B at its 131072 positions holds 4 GiB of K and V: refused with 3 GiB free,
    given with 5."""
    memory = namedtuple("memory", "available")
    limit = LLAMA_1B.max_position_embeddings
    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: memory(3 << 30))
    with pytest.raises(ContextError, match=r"needs 4\.00 GiB .* 3\.00 GiB are available"):
        context_positions(LLAMA_1B, limit, 4096)
    assert context_positions(LLAMA_1B, limit // 2, 4096) == limit // 2
    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: memory(5 << 30))
    assert context_positions(LLAMA_1B, limit, 4096) == limit


@pytest.mark.parametrize("past,message", [(1, "past this model's limit"), (0, "GiB are available")])
def test_the_command_line_refuses_in_one_line_before_loading(past, message, monkeypatch, capsys):
    """One position past the tiny model's limit; or its whole limit on a machine left 1 KiB."""
    memory = namedtuple("memory", "available")
    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: memory(1 << 10))

    def no_load(*a, **k):
        raise AssertionError("weights were loaded")
    monkeypatch.setattr(session_module, "load_weights", no_load)
    monkeypatch.setattr(session_module, "DeviceModel", no_load)
    limit = session_module.resolve_model("tiny", lambda s: None, "bf16").config.max_position_embeddings
    code = run.run_cli(["--model", "tiny", "--device", "sim", "--max-context", str(limit + past), "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: MAX_CONTEXT={limit + past}")
    assert message in err[0]


def test_a_device_model_built_directly_makes_the_same_check(tiny_weights, tmp_path):
    """Checkers and tests build a DeviceModel without a session: the same rule holds there,
    before a kernel is compiled."""
    from llama_runtime.engine.device_model import DeviceModel
    from npu_runtime.cache import KernelCache
    from npu_runtime.sim.device import SimDevice

    limit = tiny_weights.config.max_position_embeddings
    with pytest.raises(ContextError, match=f"past this model's limit of {limit} positions"):
        DeviceModel(KernelCache(SimDevice(), tmp_path), tiny_weights, limit + 1)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("quant", ["bf16", "q4nx"])
def test_the_weights_check_prices_what_the_format_holds(quant):
    """`device_weight_bytes` is the bytes of the linear weights and the head as loaded."""
    from llama_runtime.checkpoints.loader import device_weight_bytes, load_weights

    w = load_weights("tiny", quant, lambda s: None)
    held = [t for lw in w.layers for n, t in lw.by_name().items() if not n.endswith("norm")] + [w.lm_head]
    assert device_weight_bytes(w.config, quant) == sum(t.nbytes for t in held)
    assert device_weight_bytes(LLAMA_1B, "q4nx") < device_weight_bytes(LLAMA_1B) / 3


def test_a_model_whose_weights_cannot_fit_is_refused_in_one_line_before_loading(monkeypatch, capsys):
    """A machine with room for the KV cache but one byte short of the weights."""
    from llama_runtime.checkpoints.loader import device_weight_bytes

    memory = namedtuple("memory", "available")
    cfg = session_module.resolve_model("tiny", lambda s: None, "bf16").config
    need = device_weight_bytes(cfg)
    assert kv_cache_bytes(cfg, cfg.max_position_embeddings) < need
    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: memory(need - 1))

    def no_load(*a, **k):
        raise AssertionError("weights were loaded")
    monkeypatch.setattr(session_module, "load_weights", no_load)
    code = run.run_cli(["--model", "tiny", "--device", "sim", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "its weights in bf16 need" in err[0] and "GiB are available" in err[0]
    assert "QUANT=q4nx" in err[0]
