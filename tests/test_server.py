"""`make serve` as its clients see it: the real `openai` client (and raw HTTP where the client
would refuse to send a bad request) against one server process on a loopback port.

The server runs the embedded model on the simulated device in a subprocess started once for
the module, so its memory can be measured and Ctrl-C sent to it at the end.
"""
from __future__ import annotations

import http.client
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest
import tokenizers
from openai import OpenAI
from pydantic import BaseModel, Field

from llama_runtime.checkpoints.resolve import resolve_model
from llama_runtime.serve.app import DEFAULT_HOST

REPO = Path(__file__).resolve().parents[1]
MODEL = "embedded"
MAX_CONTEXT = 512
QUEUE_SIZE = 8                  # the concurrency test fills it exactly; the 503 test overflows it by one
STARTUP_TIMEOUT_S = 180
REFUSAL_TIMEOUT_S = 15         # well within the LONG answer that holds the device meanwhile
STOP_TIMEOUT_S = 15            # a guard against a hung server, not a speed limit
JAPAN = [{"role": "user", "content": "What is the capital of Japan?"}]
COUNTING = "1, 2, 3, 4, 5,"     # a raw prompt the model continues for hundreds of tokens
LONG = 300
WEB_ORIGIN = "http://localhost:5173"   # the one origin the test server lets browsers call it from
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                         "parameters": {"type": "object", "required": ["city"],
                                                        "properties": {"city": {"type": "string", "maxLength": 20}},
                                                        "additionalProperties": False}}}


class Server:
    def __init__(self, proc: subprocess.Popen, log: Path, port: int):
        self.proc, self.log_path, self.port = proc, log, port
        self.base_url = f"http://{DEFAULT_HOST}:{port}/v1"
        self.client = OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120)

    def log(self) -> str:
        return self.log_path.read_text()

    def log_line(self, request_id: str, timeout: float = 5.0) -> str:
        """The server's line for one request (it is written just before the answer ends)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [l for l in self.log().splitlines() if request_id in l]
            if lines or time.monotonic() > deadline:
                assert lines, f"no log line for {request_id}"
                return lines[0]
            time.sleep(0.05)

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(DEFAULT_HOST, self.port, timeout=120)

    def post(self, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict, dict]:
        """Status, headers and JSON body of one request sent as given."""
        status, headers, data = self.request("POST", path, raw if raw is not None else json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
        return status, headers, json.loads(data)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, dict, bytes]:
        conn = self.connection()
        try:
            conn.request(method, f"/v1{path}", body, headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def open_stream(self, body: dict, events: int) -> tuple[http.client.HTTPConnection, list[str]]:
        """Start a streamed answer and read its first `events` server-sent events."""
        conn = self.connection()
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        got = []
        while len(got) < events:
            line = r.readline().decode()
            if line.startswith("data: "):
                got.append(line[len("data: "):].strip())
        return conn, got


@pytest.fixture(scope="module")
def server():
    # Not under pytest's tmp_path: a concurrent pytest run may prune those folders mid-module.
    with tempfile.NamedTemporaryFile("w", prefix="llama-serve-", suffix=".log", delete=False) as out:
        log = Path(out.name)
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "llama32_1b_inference.py"), "--serve", "--model", MODEL, "--device", "sim",
             "--max-context", str(MAX_CONTEXT), "--host", DEFAULT_HOST, "--port", "0",
             "--queue-size", str(QUEUE_SIZE), "--cors-origin", WEB_ORIGIN],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (m := re.search(r"API at http://[^:]+:(\d+)/v1", log.read_text())):
            assert proc.poll() is None, f"the server exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"the server did not start: {log.read_text()}"
            time.sleep(0.2)
        yield Server(proc, log, int(m.group(1)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)


def _chat(server, messages=JAPAN, **kw):
    return server.client.chat.completions.create(model=MODEL, messages=messages, **kw)


def _streamed_chat(server, **kw) -> tuple[str, list]:
    chunks = list(_chat(server, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ---- answers ----------------------------------------------------------------------------
def test_the_one_model_is_listed(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]


def test_chat_answers_and_the_stream_carries_the_same_text(server):
    r = _chat(server, temperature=0)
    answer = r.choices[0].message.content
    assert "Tokyo" in answer and r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens and u.total_tokens == u.prompt_tokens + u.completion_tokens

    text, chunks = _streamed_chat(server, temperature=0)
    assert text == answer
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    timings = chunks[-1].usage.model_extra["timings"]
    assert timings["ttft_s"] > 0 and timings["tokens_per_s"] > 0 and timings["queued_s"] >= 0
    assert all(c.usage is None for c in chunks[:-1])

    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 16}
    text, _ = _streamed_chat(server, **sampled)
    assert text == _chat(server, **sampled).choices[0].message.content


def test_completions_honour_stop_strings_and_the_token_budget(server):
    c = server.client.completions
    full = c.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    assert full.choices[0].text.startswith(" 6, 7, 8")

    cut = c.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0, stop=[" 9", "never"])
    assert cut.choices[0].text == " 6, 7, 8," and cut.choices[0].finish_reason == "stop"
    streamed = c.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0, stop=" 9", stream=True)
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == " 6, 7, 8,"
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_concurrent_clients_get_the_answers_they_get_alone(server):
    questions = [f"What is the capital of {country}?" for country in ("France", "Italy", "Germany", "Japan")]
    ask = lambda q: _chat(server, messages=[{"role": "user", "content": q}], max_tokens=8,
                          temperature=0).choices[0].message.content
    alone = {q: ask(q) for q in questions}
    batch = questions * 2                  # 8 clients: one answered at a time, the rest queued
    with ThreadPoolExecutor(len(batch)) as pool:
        together = list(pool.map(ask, batch))
    assert together == [alone[q] for q in batch]


def test_a_second_turn_prefills_only_its_new_tokens(server):
    first = _chat(server, messages=[{"role": "user", "content": "Name a large city in Italy."}], temperature=0,
                  max_tokens=12)
    followup = [{"role": "user", "content": "Name a large city in Italy."},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And one in Spain?"}]
    second = _chat(server, messages=followup, temperature=0, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert f"{second.id} prompt {second.usage.prompt_tokens} tokens, {cached} reused" in server.log_line(second.id)


# ---- OpenAI's finer points ----------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(resolve_model(MODEL).folder / "tokenizer.json"))


def test_one_model_can_be_retrieved_by_id(server):
    m = server.client.models.retrieve(MODEL)
    assert (m.id, m.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError) as e:
        server.client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


def test_completions_default_to_16_tokens(server):
    r = server.client.completions.create(model=MODEL, prompt=COUNTING, temperature=0)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_logit_bias_steers_the_choice(server, vocab):
    plain = server.client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=4, temperature=0)
    assert plain.choices[0].text.startswith(" 6")
    banned = {str(i): -100 for i in vocab.encode(" 6, 7").ids}
    steered = server.client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=4, temperature=0,
                                               logit_bias=banned)
    assert not set(vocab.encode(steered.choices[0].text).ids) & {int(i) for i in banned}, steered.choices[0].text


def test_an_answer_cut_inside_a_character_ends_before_it(server, vocab):
    first_byte = vocab.token_to_id("æ")       # 0xE6: the first of the three bytes of e.g. 日 or 本
    body = dict(model=MODEL, prompt="In Japanese, Japan is", max_tokens=1, temperature=0,
                logit_bias={str(first_byte): 100})
    r = server.client.completions.create(**body)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == ""
    pieces = list(server.client.completions.create(**body, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == ""


def test_top_p_zero_is_greedy(server):
    greedy = _chat(server, temperature=0, max_tokens=12).choices[0].message.content
    assert _chat(server, temperature=1, top_p=0, max_tokens=12).choices[0].message.content == greedy


def test_developer_and_leading_system_messages_form_one_system_block(server):
    say = [{"role": "user", "content": "Say one word."}]
    ask = lambda msgs: _chat(server, messages=msgs + say, temperature=0, max_tokens=8).choices[0].message.content
    one = ask([{"role": "system", "content": "You are a pirate.\n\nAnswer in capitals."}])
    assert ask([{"role": "developer", "content": "You are a pirate.\n\nAnswer in capitals."}]) == one
    assert ask([{"role": "system", "content": "You are a pirate."},
                {"role": "developer", "content": "Answer in capitals."}]) == one


def test_an_assistant_turn_that_called_tools_is_accepted(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "capital", "arguments": '{"country": "Japan"}'}}
    r = _chat(server, messages=JAPAN + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                        {"role": "user", "content": "Just tell me."}], temperature=0, max_tokens=8)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 0


# ---- log probabilities -------------------------------------------------------------------
def test_chat_logprobs_describe_the_answer_streamed_or_not(server):
    r = _chat(server, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert bytes(t.bytes).decode() == t.token and t.logprob <= 0
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)  # greedy: the likeliest

    text, chunks = _streamed_chat(server, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert text == r.choices[0].message.content
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]
    assert _chat(server, temperature=0, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_with_echo_score_the_prompt_as_generation_did(server):
    c = server.client.completions
    gen = c.create(model=MODEL, prompt=COUNTING, max_tokens=4, temperature=0, logprobs=2)
    lp = gen.choices[0].logprobs
    assert "".join(lp.tokens) == gen.choices[0].text and len(lp.token_logprobs) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(top) == 2 and max(top.values()) == l for top, l in zip(lp.top_logprobs, lp.token_logprobs))

    echoed = c.create(model=MODEL, prompt=COUNTING + gen.choices[0].text, max_tokens=1, temperature=0, logprobs=2,
                      echo=True)
    e = echoed.choices[0]
    assert e.text.startswith(COUNTING + gen.choices[0].text)
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert "".join(e.logprobs.tokens) == e.text
    # The generated tokens, read back as the end of a prompt, get the scores they were generated with.
    tail = e.logprobs.token_logprobs[-5:-1]
    assert e.logprobs.tokens[-5:-1] == lp.tokens
    assert tail == pytest.approx(lp.token_logprobs, abs=0.05)

    pieces = list(c.create(model=MODEL, prompt=COUNTING, max_tokens=4, temperature=0, logprobs=2, echo=True,
                           stream=True))
    assert "".join(p.choices[0].text for p in pieces) == COUNTING + gen.choices[0].text
    offsets = [o for p in pieces if p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(offsets) == echoed.usage.prompt_tokens
    plain = c.create(model=MODEL, prompt=COUNTING, max_tokens=4, temperature=0, echo=True)
    assert plain.choices[0].text == COUNTING + gen.choices[0].text and plain.choices[0].logprobs is None


# ---- structured output ---------------------------------------------------------------------
class City(BaseModel):
    name: str = Field(max_length=24)         # bounded, so a small model cannot ramble past max_tokens
    country: str = Field(max_length=24)
    population: int


CITY_QUESTION = [{"role": "user", "content": "Describe the capital of Japan as JSON."}]


def test_parse_with_a_pydantic_model_gets_a_valid_object(server):
    r = server.client.chat.completions.parse(model=MODEL, messages=CITY_QUESTION, temperature=0, max_tokens=80,
                                             response_format=City)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, City)

    schema = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}}
    text, chunks = _streamed_chat(server, messages=CITY_QUESTION, temperature=0.8, seed=3, max_tokens=80,
                                  response_format=schema)
    City.model_validate_json(text)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_logprobs_under_a_grammar_list_only_the_tokens_it_allows(server):
    r = _chat(server, messages=CITY_QUESTION, temperature=0, max_tokens=4, response_format={"type": "json_object"},
              logprobs=True, top_logprobs=20)
    first = r.choices[0].logprobs.content[0]
    assert first.token == "{" and 1 <= len(first.top_logprobs) < 20    # only "{"-like tokens can open an object
    assert sum(math.exp(t.logprob) for t in first.top_logprobs) == pytest.approx(1, abs=1e-3)


def test_json_object_mode_answers_an_object_or_ends_with_length(server):
    r = _chat(server, messages=CITY_QUESTION, temperature=0, max_tokens=80, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    cut = _chat(server, messages=CITY_QUESTION, temperature=0, max_tokens=3, response_format={"type": "json_object"})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content)


# ---- tools ----------------------------------------------------------------------------------
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": TOOL["function"]["parameters"]}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("tool_choice, name", [("required", None), ({"type": "function", "function": {"name": "get_time"}},
                                                                    "get_time")])
def test_a_required_call_comes_back_as_tool_calls_streamed_or_not(server, tool_choice, name):
    kw = dict(messages=WEATHER_QUESTION, tools=[TOOL, CLOCK], tool_choice=tool_choice, temperature=0, max_tokens=40)
    r = _chat(server, **kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None and len(m.tool_calls) == 1
    call = m.tool_calls[0]
    assert call.function.name in ({"get_weather", "get_time"} if name is None else {name})
    assert set(json.loads(call.function.arguments)) == {"city"}

    _, chunks = _streamed_chat(server, **kw)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == \
           [(0, call.function.name, call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_lets_the_model_answer_in_text_and_a_tool_result_is_read_on_the_next_turn(server):
    r = _chat(server, messages=WEATHER_QUESTION, tools=[TOOL], temperature=0, max_tokens=12)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    text, _ = _streamed_chat(server, messages=WEATHER_QUESTION, tools=[TOOL], temperature=0, max_tokens=12)
    assert text == r.choices[0].message.content
    turn = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "It is 18 C and sunny in Paris."}]
    answer = _chat(server, messages=turn, tools=[TOOL], temperature=0, max_tokens=24)
    # a text answer about the city of the call, ended by the model within its budget
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.tool_calls is None
    assert "Paris" in answer.choices[0].message.content


def test_cors_preflight_answers_only_the_configured_origin(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    status, headers, _ = server.request("OPTIONS", "/chat/completions", headers={"Origin": WEB_ORIGIN, **preflight})
    assert status == 200 and headers["access-control-allow-origin"] == WEB_ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    status, headers, _ = server.request("OPTIONS", "/chat/completions",
                                        headers={"Origin": "http://evil.test", **preflight})
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = server.request("GET", "/models", headers={"Origin": WEB_ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == WEB_ORIGIN


def test_a_wrong_method_gets_405_with_allow(server):
    status, headers, body = server.request("GET", "/chat/completions")
    assert status == 405 and headers["allow"] == "POST"
    assert json.loads(body)["error"]["code"] == "method_not_allowed"


def test_refused_and_model_free_requests_are_logged_too(server):
    status, _, _ = server.post("/completions", {"model": MODEL, "prompt": "hi", "best_of": 3})
    assert status == 400
    assert "POST /v1/completions refused: 400 invalid_request_error: only best_of=1" in server.log()
    status, _, _ = server.request("GET", f"/models/{MODEL}")
    assert status == 200 and f"GET /v1/models/{MODEL} 200" in server.log()


# ---- one model, one device ----------------------------------------------------------------
def _probe(server) -> None:
    r = server.client.completions.create(model=MODEL, prompt="The opposite of hot is", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1


def _generated(line: str) -> int:
    return int(re.search(r"(\d+) generated", line).group(1))


def test_a_client_that_leaves_frees_the_device_at_the_next_token(server):
    """The log line of a request whose client left counts the tokens it generated: a few past
    what the client read, never the LONG it asked for."""
    conn, events = server.open_stream({"model": MODEL, "prompt": COUNTING, "max_tokens": LONG, "temperature": 0}, 6)
    rid = json.loads(events[0])["id"]
    conn.close()
    _probe(server)
    line = server.log_line(rid)
    assert "cancelled by client" in line and _generated(line) < len(events) + 5, line

    # A non-streamed answer whose client times out is cancelled too.
    cancelled = server.log().count("cancelled by client")
    conn = server.connection()
    # greedy, so the answer runs for LONG tokens unless the cancellation stops it
    conn.request("POST", "/v1/completions",
                 json.dumps({"model": MODEL, "prompt": COUNTING, "max_tokens": LONG, "temperature": 0}).encode(),
                 {"Content-Type": "application/json"})
    time.sleep(0.5)
    conn.close()
    _probe(server)                     # queued behind the abandoned answer, so it ends after it
    lines = [l for l in server.log().splitlines() if "cancelled by client" in l]
    assert len(lines) == cancelled + 1 and _generated(lines[-1]) < LONG, lines[-1]


def test_a_client_that_leaves_while_queued_still_gets_a_log_line(server):
    conn, _ = server.open_stream({"model": MODEL, "prompt": COUNTING, "max_tokens": LONG, "temperature": 0}, 2)
    queued = server.connection()
    try:                               # the stream holds the device, so this one waits in the queue
        queued.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode(),
                       {"Content-Type": "application/json"})
        time.sleep(0.5)
        queued.close()
        time.sleep(0.3)
    finally:
        conn.close()
    _probe(server)                     # queued behind the skipped job, so that one has been logged
    assert re.search(r"\] \S+ prompt \d+ tokens, never started: queued [\d.]+ s, cancelled by client", server.log())


def test_a_full_queue_answers_503_with_retry_after(server):
    conn, _ = server.open_stream({"model": MODEL, "prompt": COUNTING, "max_tokens": LONG, "temperature": 0}, 2)
    try:                                   # the stream holds the device; QUEUE_SIZE + 1 more arrive
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
        with ThreadPoolExecutor(QUEUE_SIZE + 1) as pool:
            futures = [pool.submit(server.post, "/completions", body) for _ in range(QUEUE_SIZE + 1)]
            deadline = time.monotonic() + REFUSAL_TIMEOUT_S
            while not any(f.done() for f in futures) and time.monotonic() < deadline:
                time.sleep(0.05)           # the refusal comes at once; the others wait for the device
            time.sleep(0.3)
            early = sum(f.done() for f in futures)
            conn.close()                   # the queued ones now run, one token each
            results = [f.result() for f in futures]
    finally:
        conn.close()
    refused = [r for r in results if r[0] != 200]
    assert early == 1 and len(refused) == 1, results
    status, headers, err = refused[0]
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert err["error"]["type"] == "server_error" and err["error"]["code"] == "server_busy"


# ---- bad requests -----------------------------------------------------------------------
USER = [{"role": "user", "content": "hi"}]
BAD = [
    # (route, body or raw bytes, status, param, code)
    ("/chat/completions", b"{not json", 400, None, None),
    ("/chat/completions", b"[1, 2]", 400, None, None),
    ("/chat/completions", {"messages": USER}, 400, "model", None),
    ("/chat/completions", {"model": "gpt-4o", "messages": USER}, 404, "model", "model_not_found"),
    ("/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content", None),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role",
     None),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages", None),
    ("/chat/completions", {"model": MODEL, "messages": USER + [{"role": "system", "content": "x"}]}, 400,
     "messages[1].role", None),
    ("/chat/completions", {"model": MODEL, "messages": USER + [{"role": "developer", "content": "x"}]}, 400,
     "messages[1].role", None),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "assistant", "content": None}] + USER}, 400,
     "messages[0].content", None),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * MAX_CONTEXT}]},
     400, "messages", "context_length_exceeded"),
    ("/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 0}, 400, "max_tokens", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": -5}, 400, "max_tokens", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 10**12}, 400, "max_tokens", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "max_completion_tokens": "9"}, 400,
     "max_completion_tokens", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "temperature": "warm"}, 400, "temperature", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "temperature": 3}, 400, "temperature", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "top_p": -0.1}, 400, "top_p", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "top_p": 1.5}, 400, "top_p", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "logit_bias": [1]}, 400, "logit_bias", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "logit_bias": {"-1": 1}}, 400, "logit_bias", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "logit_bias": {"49152": 1}}, 400, "logit_bias", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "logit_bias": {"5": 100.5}}, 400, "logit_bias", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "logit_bias": {"5": "1"}}, 400, "logit_bias", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "tool_choice": "auto"}, 400, "tool_choice", None),
    ("/completions", {"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "logprobs": 1}, 400, "logprobs", None),
    ("/completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs", None),
    ("/completions", {"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs", None),
    ("/completions", {"model": MODEL, "prompt": "hi", "echo": "yes"}, 400, "echo", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "tools": {"name": "f"}}, 400, "tools", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0]", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "tools": [TOOL, TOOL]}, 400, "tools[1].function.name", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "tools": [TOOL], "tool_choice": "always"}, 400,
     "tool_choice", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "tools": [TOOL],
                           "tool_choice": {"type": "function", "function": {"name": "other"}}}, 400, "tool_choice", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "functions": [TOOL["function"]]}, 400, "functions", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "tools": [TOOL], "tool_choice": "required",
                           "response_format": {"type": "json_object"}}, 400, "response_format", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "response_format": {"type": "xml"}}, 400,
     "response_format", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, 400, "response_format.json_schema.schema", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}, 400,
     "response_format.json_schema.schema", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "http://elsewhere.test/s.json"}}}}, 400,
     "response_format.json_schema.schema", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "n": 2}, 400, "n", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "stop": [1]}, 400, "stop", None),
    ("/chat/completions", {"model": MODEL, "messages": USER, "stream": "yes"}, 400, "stream", None),
    ("/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("/completions", {"model": MODEL, "prompt": {"text": "hi"}}, 400, "prompt", None),
    ("/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt", None),
    ("/completions", {"model": MODEL, "prompt": "word " * MAX_CONTEXT}, 400, "prompt", "context_length_exceeded"),
    ("/nowhere", {}, 404, None, "not_found"),
]


@pytest.mark.parametrize("route, body, status, param, code", BAD)
def test_bad_requests_get_openai_errors(server, route, body, status, param, code):
    got, _, err = server.post(route, raw=body) if isinstance(body, bytes) else server.post(route, body)
    assert got == status, err
    e = err["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    assert (e["param"], e["code"]) == (param, code)


def test_bad_requests_leave_the_server_answering(server):
    assert "Tokyo" in _chat(server, temperature=0, max_tokens=12).choices[0].message.content
    assert "Traceback" not in server.log()


# ---- staying up ---------------------------------------------------------------------------
SOAK_REQUESTS = 200
SOAK_BASELINE = 20
RSS_GROWTH = 0.05


def test_a_soak_of_small_requests_keeps_time_and_memory_bounded(server):
    proc = psutil.Process(server.proc.pid)
    t0 = time.perf_counter()
    for i in range(1, SOAK_REQUESTS + 1):
        # Greedy: a sampled first token may be the end of the text, which would leave no work.
        r = server.client.completions.create(model=MODEL, prompt=f"Request {i % 7}: say hi", max_tokens=2 + i % 3,
                                             temperature=0)
        assert 1 <= r.usage.completion_tokens <= 4
        if i == SOAK_BASELINE:
            baseline = proc.memory_info().rss
    elapsed = time.perf_counter() - t0
    rss = proc.memory_info().rss
    print(f"\n[soak] {SOAK_REQUESTS} requests in {elapsed:.1f} s ({SOAK_REQUESTS / elapsed:.1f}/s); "
          f"RSS {baseline / 2**20:.0f} MiB after {SOAK_BASELINE}, {rss / 2**20:.0f} MiB after {SOAK_REQUESTS}")
    assert abs(rss - baseline) <= RSS_GROWTH * baseline


def test_ctrl_c_stops_the_server_cleanly_mid_answer(server):
    conn, _ = server.open_stream({"model": MODEL, "prompt": COUNTING, "max_tokens": LONG}, 2)
    server.proc.send_signal(signal.SIGINT)
    try:
        code = server.proc.wait(timeout=STOP_TIMEOUT_S)
    finally:
        conn.close()
    assert code == 0
    log = server.log()
    assert log.rstrip().endswith("[serve] stopped") and "Traceback" not in log
