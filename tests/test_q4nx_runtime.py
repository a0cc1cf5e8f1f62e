"""QUANT=q4nx end to end on the simulated NPU: the embedded model (its GGUF's 4-bit values) through
the same prefill and decode code as bf16, held to a bf16 session run on the same weights
dequantized, which is what `make verify QUANT=q4nx` holds it to on the HF side."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llama_base import q4nx
from llama_runtime.decode import decode_step
from llama_runtime.device_model import DeviceModel
from llama_runtime.prefill import prefill
from llama_runtime.q4nx_weights import linear_names, lm_head_rows
from llama_runtime.session import build_session
from llama_runtime.weights import LayerWeights


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return build_session("embedded", "sim", max_context=1024, cache_dir=tmp_path_factory.mktemp("kernels"),
                         buckets=(64, 256), log=lambda s: None, quant="q4nx")


@pytest.fixture(scope="module")
def dequantized(session, tmp_path_factory):
    """A bf16 device model of the q4nx session's own weights, dequantized."""
    from llama_runtime.checkpoint import load_weights

    w = load_weights(session.resolved.folder, "q4nx", lambda s: None)
    cfg = w.config
    layers = []
    for lw in w.layers:
        fields = lw.by_name()
        for short in linear_names(cfg):
            n, k = getattr(w.backing.layers[0], short).shape
            fields[short] = q4nx.dequantize(fields[short], n, k)
        layers.append(LayerWeights(**fields))
    head = q4nx.dequantize(w.lm_head, lm_head_rows(cfg), cfg.hidden_size)[:cfg.vocab_size]
    bf16 = replace(w, layers=layers, lm_head=head, quant="bf16", checkpoint=None, backing=None)
    return DeviceModel(session.kc, bf16, session.model.max_context, buckets=session.model.buckets)


def test_q4nx_groups_run_with_the_same_calls_as_bf16(session):
    layers = session.config.num_hidden_layers
    assert all(g.quant == "q4nx" for g in session.model.all_groups() if g.kind != "flash_attn")
    ids = session.encode("Hello there")
    before = session.device.counters.runs
    logits = prefill(session.model, ids)
    assert session.device.counters.runs - before == 3 * (layers - 1) + 3
    before = session.device.counters.runs
    decode_step(session.model, int(logits.argmax()), len(ids))
    assert session.device.counters.runs - before == 2 * layers + 1


def test_the_weights_are_resident_once_in_five_bits(session):
    cfg = session.config
    per_layer = sum(q4nx.nbytes(*s) for s in
                    [(cfg.q_dim, cfg.hidden_size), (cfg.kv_dim, cfg.hidden_size), (cfg.kv_dim, cfg.hidden_size),
                     (cfg.hidden_size, cfg.q_dim), (cfg.intermediate_size, cfg.hidden_size),
                     (cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)])
    norms = 2 * cfg.hidden_size * 2
    head = q4nx.nbytes(lm_head_rows(cfg), cfg.hidden_size)
    assert session.kc.resident_bytes()["static"] == cfg.num_hidden_layers * (per_layer + norms) + head


def test_q4nx_prefill_and_decode_match_bf16_on_the_dequantized_weights(session, dequantized):
    ids = session.encode("What is the capital of Japan?")
    ours = prefill(session.model, ids)
    ref = prefill(dequantized, ids)
    # Prefill multiplies exactly the dequantized bf16 weights: only summation order differs.
    assert int(ours.argmax()) == int(ref.argmax())
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=0) > 0.9999
    tok = int(ours.argmax())
    d_ours, d_ref = decode_step(session.model, tok, len(ids)), decode_step(dequantized, tok, len(ids))
    # Decode folds the dequantization into its sums: no bf16 rounding of each weight.
    assert int(d_ours.argmax()) == int(d_ref.argmax())
    assert torch.nn.functional.cosine_similarity(d_ours, d_ref, dim=0) > 0.999


def test_the_q4nx_embedded_model_answers(session):
    r = session.generate("What is the capital of Japan?", 16)
    assert "Tokyo" in r.text


def test_chunked_q4nx_prefill_equals_single_shot(session):
    ids = session.encode("Name three rivers of Europe and the seas they flow into, one per line.")
    whole = prefill(session.model, ids).clone()
    first = prefill(session.model, ids[:20])
    del first
    rest = prefill(session.model, ids[20:], start=20)
    assert int(whole.argmax()) == int(rest.argmax())
    assert torch.nn.functional.cosine_similarity(whole, rest, dim=0) > 0.999
