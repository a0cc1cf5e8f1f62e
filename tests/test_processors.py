"""Logits processors one by one and composed, without a model: the embedded model's tokenizer
and a real grammar, over logits made up for the purpose."""
from __future__ import annotations

import math

import pytest
import torch

from llama_runtime.checkpoints import builtin
from llama_runtime.generation.constrained import Grammars
from llama_runtime.generation.processors import GrammarMask, LogitBias, LogitsProcessors, processors_for
from llama_runtime.generation.sampling import Sampler, SamplingParams, greedy
from llama_runtime.text.tokenizer import Tokenizer

OBJECT = {"type": "object"}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(builtin.ensure_embedded_model())


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def _one_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode_text(text)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_no_bias_brings_back_a_token_the_grammar_masks(tokenizer, grammars):
    """The mask runs after the bias: an infinite bias on a token an object cannot start with
    leaves it forbidden, and greedy choice takes a token the grammar allows. In the other order
    the masked token's logit is -inf + inf = NaN, which greedy choice picks."""
    word = _one_token(tokenizer, "hello")
    bias = SamplingParams(logit_bias=((word, math.inf),))
    logits = torch.zeros(tokenizer.vocab_size)
    shaped = processors_for(bias, grammars.for_schema(OBJECT, "test"))(logits, [1, 2])
    assert shaped[word] == -math.inf
    assert tokenizer.decode([greedy(shaped)]).startswith("{")

    wrong_way = LogitsProcessors(GrammarMask(grammars.for_schema(OBJECT, "test")), LogitBias(bias.logit_bias))
    assert math.isnan(wrong_way(logits, [1, 2])[word])


def test_the_repetition_penalty_reads_the_model_s_logits_not_the_biased_ones():
    """A token seen before, logit 4, bias -3, penalty 2: penalised first it is 4 / 2 - 3 = -1;
    biased first it would be (4 - 3) / 2 = 0.5, the bias having decided the penalty's direction."""
    logits = torch.zeros(10)
    logits[7] = 4.0
    shaped = processors_for(SamplingParams(repetition_penalty=2.0, logit_bias=((7, -3.0),)))(logits, [7, 3])
    assert shaped[7] == -1.0
    assert shaped[3] == 0.0 and shaped.dtype == torch.float32     # zero is neither shrunk nor grown


def test_the_mask_hears_each_chosen_token_through_the_history(tokenizer, grammars):
    """Only the tokens added since its last call are fed to the grammar: after "{" and "}"
    the object is complete, and only an end token may follow."""
    mask = GrammarMask(grammars.for_schema(OBJECT, "test"))
    logits = torch.zeros(tokenizer.vocab_size)
    prompt = tokenizer.encode_text("Answer in JSON:")
    history = list(prompt)
    for piece in ("{", "}"):
        allowed = mask(logits, history) == 0
        tok = _one_token(tokenizer, piece)
        assert allowed[tok]
        history.append(tok)
    allowed = torch.nonzero(mask(logits, history) == 0).flatten().tolist()
    assert allowed and set(allowed) <= tokenizer.end_token_ids


def test_neutral_settings_compose_nothing_and_the_sampler_only_picks():
    """Without penalty, bias or grammar the logits reach the sampler as the model gave them
    (as float32); the sampler's choice is the same given the same seed."""
    logits = torch.randn(300, generator=torch.Generator().manual_seed(3)).bfloat16()
    chain = processors_for(SamplingParams())
    assert chain.processors == () and torch.equal(chain(logits, [5, 6]), logits.float())
    warm = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11)
    samplers = Sampler(warm), Sampler(warm)
    draws = [[s(logits.float()) for _ in range(8)] for s in samplers]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1
