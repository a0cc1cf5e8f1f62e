"""Prefill, decode and generation on the embedded model (SmolLM2-135M-Instruct) on the simulated NPU."""
from __future__ import annotations

import pytest
import torch

from cpu_kernels import native_cpu
from llama_base.errors import PromptError
from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.kv_cache import KVCache
from llama_runtime.engine.prefill import prefill
from llama_runtime.generation.sampling import Sampler, SamplingParams, greedy
from llama_runtime.generation.session import build_session


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """The design card's decode (2 calls a layer, host attention), whose calls these tests count;
    the fused decode's are `test_fused_decode`'s."""
    return build_session("embedded", "sim", max_context=2560, cache_dir=tmp_path_factory.mktemp("kernels"),
                         buckets=(128, 256, 2048), log=lambda s: None, decode="layers")


def _calls(session):
    return session.device.counters.runs


def _prefill_calls(layers: int, final: bool = True) -> int:
    """3 per layer but the last, which runs its K/V and, in the final chunk, `o_gemv_ffn` for the
    last row, then the LM head."""
    return 3 * (layers - 1) + (2 + 1 if final else 1)


def test_device_calls_per_layer(session):
    """Prefill: only the last row goes past the last layer's K/V, through `o_gemv_ffn` as in
    decode. Decode: 2 per layer. One LM head each."""
    layers = session.config.num_hidden_layers
    ids = session.encode("Hello there")
    before = _calls(session)
    logits = prefill(session.model, ids)
    assert _calls(session) - before == _prefill_calls(layers)
    before = _calls(session)
    decode_step(session.model, int(logits.argmax()), len(ids))
    assert _calls(session) - before == 2 * layers + 1


def test_last_row_prefill_matches_every_row_through_every_layer(session):
    """The shortcut through the last layer changes only rounding: a capture hook (diagnosis)
    runs every row through every layer with the prefill kernels, and the logits agree."""
    m = session.model
    ids = session.encode("Describe the water cycle in two sentences.")
    short = prefill(m, ids).clone()
    full = prefill(m, ids, capture=lambda *_: None)
    assert int(short.argmax()) == int(full.argmax())
    assert torch.nn.functional.cosine_similarity(short, full, dim=0) > 0.9999


def test_a_built_session_is_out_of_the_collectors_way(session):
    """Its long-lived objects sit in the permanent generation, which full collections skip."""
    import gc

    assert gc.get_freeze_count() > 0
    assert not any(o is session.model for o in gc.get_objects())


def test_padding_to_the_bucket_never_changes_the_logits(session):
    m = session.model
    ids = session.encode("Name three rivers in Europe.")
    a = prefill(m, ids)                                      # bucket 128
    m.buckets, saved = (2048,), m.buckets                     # force the largest bucket
    try:
        b = prefill(m, ids)
    finally:
        m.buckets = saved
    assert torch.equal(a, b)


def _end_bias(session, bias: float) -> SamplingParams:
    """Greedy sampling with every end token's logit moved by `bias`: -inf makes the token budget
    or the context the only way to stop, +inf makes the first token an end token."""
    return SamplingParams(logit_bias=tuple((e, bias) for e in session.tokenizer.end_token_ids))


@pytest.mark.parametrize("bias, stop_reason, n_out", [(float("-inf"), "n_tokens", 4), (float("inf"), "end_token", 0)])
def test_an_end_token_inside_the_prompt_ends_nothing(session, bias, stop_reason, n_out):
    """Only a generated end token stops an answer: one in the prompt is read like any other."""
    eos = sorted(session.tokenizer.end_token_ids)[0]
    ids = session.encode("First part.")[:-1] + [eos] + session.encode("Second part?")[1:]
    r = session.generate(ids, 4, sampling=_end_bias(session, bias), reuse_cache=False)
    assert r.prompt_tokens == r.prefill_tokens == len(ids)
    assert r.stop_reason == stop_reason and len(r.tokens) == n_out


def test_decode_reads_only_positions_up_to_the_current_one(session):
    m = session.model
    ids = session.encode("Count: one, two, three,")
    first = prefill(m, ids)
    tok, pos = int(first.argmax()), len(ids)
    clean = decode_step(m, tok, pos).clone()
    m.kv.k[:, :, pos + 1:] = float("nan")                    # everything past the current position
    m.kv.v[:, :, pos + 1:] = float("nan")
    try:
        poisoned = decode_step(m, tok, pos)
    finally:
        m.kv.k[:, :, pos + 1:] = 0
        m.kv.v[:, :, pos + 1:] = 0
    assert torch.equal(clean, poisoned)


def test_japan_answer_names_tokyo(session):
    r = session.generate("What is the capital of Japan?", 16)
    assert "Tokyo" in r.text and r.stop_reason == "end_token"


def test_chunked_prefill_equals_single_shot(session):
    m = session.model
    ids = (session.encode("Tell me a story about a lighthouse keeper and the sea.") * 20)[:300]
    single = prefill(m, ids)                                 # one 2048 chunk
    m.buckets, saved = (128, 256), m.buckets                 # now 256 + 44 at an offset
    before = _calls(session)
    try:
        chunked = prefill(m, ids)
    finally:
        m.buckets = saved
    layers = session.config.num_hidden_layers             # the first chunk stops at the last K/V
    assert _calls(session) - before == _prefill_calls(layers, final=False) + _prefill_calls(layers)
    assert int(single.argmax()) == int(chunked.argmax())
    assert torch.nn.functional.cosine_similarity(single, chunked, dim=0) > 0.999


def test_two_turn_chat_matches_a_fresh_run_of_the_transcript(session):
    from llama_runtime.generation.chat import Conversation

    conv = Conversation(session)
    layers = session.config.num_hidden_layers
    before = _calls(session)
    first = conv.ask("What is the capital of Japan?", 12)
    # the answer ends itself: every answer token, then the end token, was fed back by a decode step
    assert first.stop_reason == "end_token"
    assert _calls(session) - before == _prefill_calls(layers) + (2 * layers + 1) * len(first.tokens)
    before = _calls(session)
    no_end = _end_bias(session, float("-inf"))
    second = conv.ask("And of France?", 12, sampling=no_end)
    # the second turn prefilled only its new tokens: one chunk, far fewer than the transcript;
    # it runs out of tokens, so the last answer token is never fed back
    assert second.prefill_tokens < len(conv.transcript) // 2
    assert second.stop_reason == "n_tokens" and len(second.tokens) == 12
    assert _calls(session) - before == _prefill_calls(layers) + (2 * layers + 1) * 11
    fresh_ids = session.tokenizer.chat.render(conv.messages[:-1])
    fresh = session.generate(fresh_ids, 12, sampling=no_end, reuse_cache=False)
    assert fresh.tokens == second.tokens


def test_sampling_is_reproducible_with_a_seed(session):
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=7)
    a = session.generate("Write a word.", 8, sampling=p, reuse_cache=False).tokens
    b = session.generate("Write a word.", 8, sampling=p, reuse_cache=False).tokens
    c = session.generate("Write a word.", 8, sampling=SamplingParams(temperature=1.0, top_k=50, top_p=0.95,
                                                                     seed=8), reuse_cache=False).tokens
    assert a == b and a != c


def test_greedy_choice_is_torch_argmax():
    """`greedy` (numpy's argmax where it can) picks what torch.argmax picks: the first of equal
    maxima, the first NaN, index 0 of all -inf, on f32 logits made in inference mode and on what
    it hands to torch (bf16, a strided view); the greedy sampler and a verification step use it."""
    g = torch.Generator().manual_seed(5)
    cases = [torch.randn(128256, generator=g), torch.zeros(1000), torch.full((77,), float("-inf"))]
    tied = torch.randn(5000, generator=g)
    tied[[17, 4000]] = tied.max() + 1
    nan = torch.randn(5000, generator=g)
    nan[[30, 2000]] = float("nan")
    with torch.inference_mode():
        made = torch.randn(4096, generator=g) * 3
    cases += [tied, nan, made, torch.randn(3000, generator=g).bfloat16(), torch.randn(6000, generator=g)[::2]]
    for x in cases:
        assert greedy(x) == int(torch.argmax(x)), x.shape
    assert greedy(tied) == 17 and greedy(nan) == 30
    assert Sampler()(tied) == 17


def test_over_long_input_is_refused(session):
    ids = session.encode("word " * 3000)
    with pytest.raises(PromptError, match="context limit"):
        session.generate(ids, 4)
    with pytest.raises(PromptError, match="empty"):
        session.generate("   ", 4)
    with pytest.raises(PromptError, match="positive"):
        session.generate("hi", 0)


def test_the_cache_knows_its_tokens_and_a_prompt_reuses_their_prefix(session):
    ids = session.encode("Name a colour.")
    first = session.generate(ids, 3, reuse_cache=False)
    assert first.prefill_tokens == len(ids)
    assert session.cached_ids == (ids + first.tokens)[: first.cached]
    again = session.generate(ids, 3)
    # everything but the last prompt token, whose logits choose the first answer token
    assert again.prefill_tokens == 1 and again.reused_tokens == len(ids) - 1
    prefill(session.model, ids[:2])          # a step called directly keeps the record true too
    assert session.cached_ids == ids[:2]


def test_the_token_stream_yields_each_token_with_the_logits_it_was_chosen_from(session):
    """The layer under the text: greedy tokens are the argmax of the logits they come with, and
    `generate` reads the same tokens. A reader that stops after two leaves the second unfed:
    the cache holds the prompt and the first answer token, and knows it."""
    ids = session.encode("Name three colours.")
    steps = list(session.tokens(ids, 6, reuse_cache=False))
    assert len(steps) == 6 and all(s.token == greedy(s.logits) for s in steps)
    assert [s.token for s in steps] == session.generate(ids, 6, reuse_cache=False).tokens
    stream = session.tokens(ids, 6)
    for i, _ in enumerate(stream):
        if i == 1:
            break
    assert stream.stop_reason is None and stream.tokens == [s.token for s in steps[:2]]
    assert stream.cached == len(ids) + 1 and session.cached_ids == ids + stream.tokens[:1]
    with pytest.raises(RuntimeError, match="once"):
        iter(stream)


def test_a_stop_string_ends_the_answer_before_it_and_is_never_streamed(session):
    prompt = "What is the capital of Japan?"
    full = session.generate(prompt, 16, reuse_cache=False)
    assert "Tokyo" in full.text
    pieces: list[str] = []
    cut = session.generate(prompt, 16, pieces.append, stop=("never", "Tokyo"))
    assert cut.stop_reason == "stop_string" and cut.stop_string == "Tokyo"
    assert cut.text == "".join(pieces) == full.text[: full.text.index("Tokyo")]
    assert cut.tokens == full.tokens[: len(cut.tokens)] and len(cut.tokens) < len(full.tokens)


def test_generation_stops_at_the_context_limit(session):
    """Three free positions: three answer tokens are fed back, and a fourth is chosen from the
    last one. End tokens are forbidden, so the context is the only limit reached."""
    limit = session.model.max_context
    ids = session.encode("a b c d e f g h")
    filler = (session.encode("Tell me about the sea.") * limit)[: limit - len(ids) - 3]
    r = session.generate(filler + ids, 50, sampling=_end_bias(session, float("-inf")))
    assert r.stop_reason == "context_limit" and len(r.tokens) == 4 and r.cached == limit


@pytest.mark.parametrize("native", [True, False])
def test_kv_cache_write_is_head_major_for_one_row_and_many(monkeypatch, native):
    """A decode step's single row is stored natively where the CPU allows, else as a prompt's
    rows are; every way lands head-major."""
    if not native:
        monkeypatch.setattr(native_cpu, "kv_store_row", lambda *a: False)
    elif native_cpu._library() is None:
        pytest.skip("no native library on this CPU")
    kvh, d = 3, 8
    rows = torch.arange(5 * kvh * d, dtype=torch.float32).bfloat16().view(5, kvh * d)
    one, many = KVCache(2, kvh, 16, d), KVCache(2, kvh, 16, d)
    for i in range(5):
        one.write(1, 4 + i, rows[i:i + 1], -rows[i:i + 1])
    many.write(1, 4, rows, -rows)
    assert torch.equal(one.k, many.k) and torch.equal(one.v, many.v)
    assert torch.equal(many.k[1, 2, 6], rows[2].view(kvh, d)[2])      # head 2 at position 6
    assert many.k[0].abs().sum() == 0 and many.k[1, :, :4].abs().sum() == 0 and many.k[1, :, 9:].abs().sum() == 0
def test_kv_cache_row_outside_the_cache_is_refused_not_written():
    """The native row store writes by pointer arithmetic, so what is out of range must fall to
    the indexed path, which raises, instead of landing in other memory."""
    kvh, d = 2, 8
    cache = KVCache(2, kvh, 4, d)
    row = torch.ones(1, kvh * d, dtype=torch.bfloat16)
    with pytest.raises(IndexError):
        cache.write(2, 0, row, row)                   # no layer 2
    with pytest.raises(IndexError):
        cache.write(0, 4, row, row)                   # past the last position
    with pytest.raises(RuntimeError):
        cache.write(0, 0, row[:, :-1], row[:, :-1])   # a row of the wrong width
    assert cache.k.abs().sum() == 0 and cache.v.abs().sum() == 0




def test_the_bench_s_decode_split_times_the_device_s_runs_and_leaves_no_profiler_behind(session):
    """The bench's host-share measurement turns a profiler on for its own steps only: afterwards
    the session records nothing, and greedy decoding gives the tokens it gave before."""
    from verify.our_runner import OurRunner

    runner, ids = OurRunner(session), session.encode("The capital of France is")

    def greedy(n=4):
        tok, out = runner.prefill(ids).top1, []
        for pos in range(len(ids), len(ids) + n):
            out.append(tok)
            tok = runner.decode_step(tok, pos).top1
        return out

    before = greedy()
    split = runner.decode_split(ids, 4)
    assert split["steps"] == 4 and 0 < split["device_run_s"] < split["step_s"]
    assert not session.model.profiler.enabled and not session.kc.profiler.enabled
    assert session.model.profiler.groups == {} and session.kc.profiler.host == {}
    assert greedy() == before
