"""The perplexity measure: its arithmetic, its text, and our scores against HF's on a trained model."""
from __future__ import annotations

import json
import math

import pytest
import torch

from llama32_1b_inference import build_session
from llama_base.config import LlamaConfig
from llama_runtime.checkpoints.builtin import ensure_embedded_model
from llama_runtime.text.tokenizer import Tokenizer
from verify import VerifyError, eval_text
from verify import perplexity as perplexity_cli
from verify.eval_text import eval_chunks
from verify.hf_runner import HFRunner
from verify.our_runner import OurRunner
from verify.runner import run_trace
from verify.scoring import agreement, perplexity, score_chunks


class _Uniform:
    """Every token equally likely over `vocab` ids: perplexity exactly `vocab`, top-1 always 0."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def score(self, ids):
        return [math.log(self.vocab)] * (len(ids) - 1), [0] * (len(ids) - 1)


def test_a_uniform_model_s_perplexity_is_its_vocabulary_size():
    scores = score_chunks(_Uniform(1000), [[1, 5, 6, 7], [1, 8]])
    assert len(scores["nll"]) == 4 and scores["top1"] == [0, 0, 0, 0]
    assert perplexity(scores["nll"]) == pytest.approx(1000)
    assert perplexity([0.0, math.log(4.0)]) == pytest.approx(2.0)          # exp of the mean, not mean of exps
    assert agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    with pytest.raises(ValueError):
        agreement([1], [1, 2])
    with pytest.raises(ValueError, match="at least one token to predict"):
        score_chunks(_Uniform(10), [[1]])


def test_a_scorer_that_skips_positions_is_refused():
    class Short(_Uniform):
        def score(self, ids):
            n, t = super().score(ids)
            return n[1:], t[1:]

    with pytest.raises(ValueError, match="2 / 2 scores for 3 predicted tokens"):
        score_chunks(Short(10), [[1, 2, 3, 4]])


@pytest.fixture(scope="module")
def embedded():
    folder = ensure_embedded_model()
    return folder, Tokenizer(folder, LlamaConfig.from_json(folder))


def test_the_text_is_real_news_prose_in_consecutive_chunks_after_bos(embedded):
    _, tok = embedded
    assert eval_text.eval_text().startswith("Hundreds of people have been forced to vacate their homes")
    chunks = eval_chunks(tok)
    assert len(chunks) == eval_text.N_CHUNKS and {len(c) for c in chunks} == {eval_text.CHUNK_LEN + 1}
    assert eval_text.N_CHUNKS * eval_text.CHUNK_LEN >= 4096
    assert all(c[0] == tok.bos_token_id for c in chunks)
    whole = tok.encode_text(eval_text.eval_text())
    assert chunks[1][1:] == whole[eval_text.CHUNK_LEN:2 * eval_text.CHUNK_LEN]
    with pytest.raises(VerifyError, match="need 1000000"):
        eval_chunks(tok, 1, 1_000_000)


def test_a_different_file_is_refused(tmp_path, monkeypatch):
    other = tmp_path / "lee_background.cor"
    other.write_text("Not the corpus.\n")
    monkeypatch.setattr(eval_text, "eval_text_path", lambda: other)
    with pytest.raises(VerifyError, match="SHA-256 differs"):
        eval_text.eval_text()


def test_our_scores_are_our_decode_logits_and_close_to_hf_s(embedded):
    """Our scorer's numbers are exactly the logits our decode loop produces for the same tokens,
    and a trained model's perplexity on the text is that of HF's on the same checkpoint."""
    folder, tok = embedded
    (chunk,) = eval_chunks(tok, 1, 48)
    ours = OurRunner(build_session(str(folder), device="sim", max_context=64, log=lambda _: None))
    nll, top1 = ours.score(chunk)
    trace = run_trace(ours, chunk[:1], 0, (), forced=chunk[1:])
    expected = -torch.log_softmax(trace.logits, dim=-1).gather(1, torch.tensor(chunk[1:])[:, None])[:, 0]
    assert nll == pytest.approx(expected.tolist(), abs=1e-5) and top1 == trace.logits.argmax(-1).tolist()
    hf_nll, hf_top1 = HFRunner(folder).score(chunk)
    assert perplexity(nll) < 100                                    # a trained model, not a random one
    assert perplexity(nll) == pytest.approx(perplexity(hf_nll), rel=0.03)
    assert agreement(top1, hf_top1) >= 0.9


def test_the_command_reports_every_format_against_the_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_NPU_REPORTS", str(tmp_path))
    assert perplexity_cli.main(["--model", "embedded", "--device", "sim", "--chunks", "1", "--chunk-len", "16"]) == 0
    (jpath,) = tmp_path.glob("perplexity-*.json")
    data = json.loads(jpath.read_text())
    assert list(data["results"]) == ["bf16", "q4nx"] and data["reference"] == "bf16"
    assert data["results"]["bf16"]["top1_agreement"] == 1.0 and data["results"]["q4nx"]["tokens"] == 16
    assert not data["random_weights"] and "Lee background corpus" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        perplexity_cli.main(["--quants", "bf16,int3"])
    assert e.value.code == 2 and "known: bf16, q4nx" in capsys.readouterr().err
