"""A context past 8K positions on the resident cache: the tiny model's layers, its positions
limit raised, filled by chunked prefill and read by fused decode tokens far apart, against HF
transformers on the same weights."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from llama_runtime.checkpoints.builtin import ensure_tiny_checkpoint
from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.prefill import prefill
from llama_runtime.generation.session import build_session

POSITIONS = 16384
PROMPT = 8300


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    """The tiny checkpoint with a 16384-position limit (its RoPE has no such bound)."""
    src, dst = ensure_tiny_checkpoint(), tmp_path_factory.mktemp("tiny-long")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = POSITIONS
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.slow
def test_fused_decode_past_8k_positions_matches_hf(long_tiny, tmp_path):
    s = build_session(str(long_tiny), "sim", PROMPT + 8, cache_dir=tmp_path, log=lambda _: None, decode="fused")
    assert s.model.resident and s.model.capacity >= PROMPT + 8
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, s.config.vocab_size - 10, (PROMPT + 3,), generator=g).tolist()
    ours = [prefill(s.model, ids[:PROMPT])]
    for i in range(3):                              # tokens at 8300, 8301, 8302 read the whole cache
        ours.append(decode_step(s.model, ids[PROMPT + i], PROMPT + i))
    # and a token at position 1 after a fresh start: the cache's first positions, far from the last
    early = decode_step(s.model, ids[1], 1)
    del s
    hf = AutoModelForCausalLM.from_pretrained(long_tiny, dtype=torch.bfloat16, local_files_only=True).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for i, got in enumerate(ours):
        want = ref[PROMPT - 1 + i]
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99, i
        assert int(got.argmax()) in want.topk(5).indices.tolist(), i
    assert torch.nn.functional.cosine_similarity(early, ref[1], dim=0) > 0.99
