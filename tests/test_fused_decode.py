"""The fused decode (`DECODE=fused`): one device call a token, the KV cache resident on the
device, against the design card's decode on the same weights."""
from __future__ import annotations

import pytest
import torch

from kernel_builder.fused_groups import decode_windows
from llama_base.group_contract import FUSED_KIND, Role
from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.device_model import choose_decode
from llama_runtime.engine.kv_cache import ResidentKV, kv_cache_bytes
from llama_runtime.engine.prefill import prefill
from llama_runtime.generation.session import build_session

PROMPTS = ("The capital of Japan is", "Water boils at a temperature of")


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kernels")
    return {d: build_session("embedded", "sim", 512, cache_dir=cache, log=lambda _: None, decode=d)
            for d in ("layers", "fused")}


def test_fused_and_layers_give_the_same_greedy_tokens(sessions):
    for prompt in PROMPTS:
        got = {d: s.generate(prompt, n_tokens=24, chat=False, reuse_cache=False).tokens for d, s in sessions.items()}
        assert got["fused"] == got["layers"], prompt


def test_a_fused_token_is_one_device_call_and_no_host_kv(sessions):
    s = sessions["fused"]
    m = s.model
    assert isinstance(m.kv, ResidentKV) and m.calls_per_token == 1 and "1 device call" in m.describe_decode()
    assert sessions["layers"].model.calls_per_token == 2 * m.config.num_hidden_layers + 1
    ids = s.tokenizer.encode_prompt(PROMPTS[0], chat=False)
    prefill(m, ids)
    runs = s.device.counters.runs
    m.native_decode = False         # the call itself, not its recording, is counted here
    try:
        decode_step(m, ids[-1], len(ids))
    finally:
        m.native_decode = True
    assert s.device.counters.runs - runs == 1


def test_prefill_and_decode_share_one_resident_cache_buffer_per_layer(sessions):
    s = sessions["fused"]
    m, kc = s.model, s.kc
    cfg = m.config
    states = kc._states
    assert sorted(states) == sorted((f"L{i}", n) for i in range(cfg.num_hidden_layers) for n in ("k_cache", "v_cache"))
    assert kc.resident_bytes()["state"] == kv_cache_bytes(cfg, m.capacity) == m.kv.nbytes
    # Every group that names a layer's cache holds that very buffer.
    for g in m.all_groups():
        for slot in g.with_role(Role.STATE):
            layers = range(cfg.num_hidden_layers) if g.kind != FUSED_KIND else [None]
            for layer in layers:
                key = g.name if layer is None else f"{g.name}_L{layer}"
                if key not in kc._sets or kc._sets[key].calls == 0:
                    continue
                bo = kc._sets[key].bos[g.index(slot.name)]
                want = slot.name.split("_", 1) if layer is None else (f"L{layer}", slot.name)
                assert bo is states[tuple(want)], (g.name, slot.name)
    assert sessions["layers"].kc.resident_bytes()["state"] == 0


def test_a_token_runs_in_the_smallest_window_that_holds_it(sessions):
    m = sessions["fused"].model
    windows = decode_windows(m.capacity)
    assert windows[-1] == m.capacity and all(a < b <= 1.5 * a for a, b in zip(windows, windows[1:-1]))
    for pos, w in ((0, windows[0]), (windows[0] - 1, windows[0]), (windows[0], windows[1])):
        assert m.fused_group(pos).ctx_len == w


def test_decoding_across_a_window_boundary_matches_the_card(sessions):
    """Positions either side of the first window's end: the next window's group reads the
    cache the first one appended to."""
    w = decode_windows(sessions["fused"].model.capacity)[0]
    ids = sessions["fused"].tokenizer.encode_prompt(PROMPTS[1] * 40, chat=False)[: w - 2]
    logits = {}
    for d, s in sessions.items():
        out = [prefill(s.model, ids)]
        for i in range(4):      # positions w-2 .. w+1
            out.append(decode_step(s.model, int(out[-1].argmax()), len(ids) + i))
        logits[d] = torch.stack(out)
    assert torch.equal(logits["fused"].argmax(-1), logits["layers"].argmax(-1))
    cos = torch.nn.functional.cosine_similarity(logits["fused"], logits["layers"], dim=-1)
    assert cos.min() > 0.999


def test_a_chat_continuation_reuses_the_resident_cache(sessions):
    s = sessions["fused"]
    first = s.generate(PROMPTS[0], n_tokens=8, chat=False, reuse_cache=False)
    ids = s.tokenizer.encode_prompt(PROMPTS[0], chat=False) + first.tokens + s.tokenizer.encode_prompt(" and", chat=False)
    reused = s.generate(ids, n_tokens=1, chat=False, logprobs=0)
    fresh = s.generate(ids, n_tokens=1, chat=False, reuse_cache=False, logprobs=0)
    assert reused.reused_tokens > len(first.tokens) and fresh.reused_tokens == 0
    assert abs(reused.logprobs[0].logprob - fresh.logprobs[0].logprob) < 0.1


def test_a_capture_hook_needs_the_layers_decode(sessions):
    m = sessions["fused"].model
    with pytest.raises(ValueError, match="DECODE=layers"):
        decode_step(m, 1, 0, capture=lambda *a: None)


def test_decode_choice():
    assert choose_decode("auto") == "fused"
    assert choose_decode("fused") == "fused" and choose_decode("layers") == "layers"
    with pytest.raises(ValueError, match="decode"):
        choose_decode("both")
