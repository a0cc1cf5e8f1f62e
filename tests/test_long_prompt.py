"""A prompt longer than the largest bucket: chunked prefill at offsets, checked against HF transformers."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llama_runtime.engine.prefill import prefill
from llama_runtime.generation.session import build_session
from verify.compare import TOP_K, gate_prompt

PROMPT_TOKENS = 3000


@pytest.mark.slow
def test_3000_token_prompt_matches_hf_within_the_gate():
    s = build_session("embedded", "sim", max_context=4096, log=lambda m: None, decode="layers")
    text = ("The lighthouse keeper wrote in his log every night: the wind, the ships, the lamp. " * 200)
    ids = s.tokenizer.encode_prompt(text, chat=False)[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS > s.model.buckets[-1]
    calls = s.device.counters.runs
    ours = prefill(s.model, ids)
    layers = s.config.num_hidden_layers
    chunks = -(-PROMPT_TOKENS // s.model.buckets[-1])
    # every chunk: 3 calls per layer but the last, whose K/V need `rms_gemms_rope` alone; the
    # final chunk's last row then goes through `o_gemv_ffn`, and the LM head runs once
    assert s.device.counters.runs - calls == (3 * (layers - 1) + 1) * chunks + 1 + 1
    folder = s.resolved.folder
    del s
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, local_files_only=True).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    gate = gate_prompt(ref[None], ours[None], TOP_K)
    assert gate.passed, gate
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=0) > 0.99
