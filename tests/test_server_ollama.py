"""The Ollama API of `make serve` as its clients see it: the real `ollama` client (and raw HTTP
where the client would refuse to send a bad request, or hides the status and body) against
the same small server tests/test_server.py starts."""
from __future__ import annotations

import http.client
import json
import re

import ollama
import pytest

from llama_runtime.checkpoints.resolve import resolve_model
from test_server import COUNTING, LONG, MAX_CONTEXT, MODEL, server  # noqa: F401 -- server: the module-scoped fixture
from test_server import City                # name, country, population; its strings bounded
from test_server import TOOL as WEATHER     # get_weather(city), in the shape Ollama's tools have too

JAPAN = [{"role": "user", "content": "What is the capital of Japan?"}]
GREEDY = {"temperature": 0}
# `format` holding the shape of a call of WEATHER: Ollama has no tool_choice, so this is how a
# client makes a model this small call the tool.
WEATHER_CALL = {"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
                "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER["function"]["parameters"]}}


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=120)


def _http(server, method: str, path: str, body: dict | bytes | None = None) -> tuple[int, dict, bytes]:  # noqa: F811
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, raw, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _counters_ok(r) -> None:
    """The last object of an answer: done, with Ollama's counters as nanosecond integers."""
    assert r.done is True and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration >= 0 and r.load_duration == 0


# ---- answers ----------------------------------------------------------------------------
def test_chat_answers_and_the_stream_carries_the_same_text(client):
    r = client.chat(model=MODEL, messages=JAPAN, options=GREEDY)
    assert "Tokyo" in r.message.content and r.message.role == "assistant" and r.model == MODEL
    _counters_ok(r)
    assert r.done_reason == "stop"

    parts = list(client.chat(model=MODEL, messages=JAPAN, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].message.content == "" and parts[-1].eval_count == r.eval_count
    _counters_ok(parts[-1])


def test_the_stream_is_newline_delimited_json(server):  # noqa: F811
    status, headers, body = _http(server, "POST", "/api/chat", {"model": MODEL, "messages": JAPAN, "options": GREEDY})
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    lines = body.decode().splitlines()
    objs = [json.loads(line) for line in lines]     # streamed unless told not to: Ollama's default
    assert len(objs) > 2 and objs[-1]["done"] and not any(o["done"] for o in objs[:-1])
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", o["created_at"]) for o in objs)


def test_generate_applies_the_chat_template_unless_raw(client):
    r = client.generate(model=MODEL, prompt="What is the capital of Japan?", options=GREEDY)
    assert "Tokyo" in r.response
    parts = list(client.generate(model=MODEL, prompt="What is the capital of Japan?", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == r.response and parts[-1].done
    _counters_ok(parts[-1])

    raw = client.generate(model=MODEL, prompt=COUNTING, raw=True, options={**GREEDY, "num_predict": 6})
    assert raw.response.startswith(" 6, 7")
    assert raw.prompt_eval_count < r.prompt_eval_count      # no chat format around the raw prompt


def test_num_predict_caps_the_answer_and_stop_ends_it(client):
    capped = client.generate(model=MODEL, prompt=COUNTING, raw=True, options={**GREEDY, "num_predict": 5})
    assert capped.eval_count == 5 and capped.done_reason == "length"

    cut = client.generate(model=MODEL, prompt=COUNTING, raw=True,
                          options={**GREEDY, "num_predict": 12, "stop": [" 9", "never"]})
    assert cut.response == " 6, 7, 8," and cut.done_reason == "stop"
    parts = list(client.generate(model=MODEL, prompt=COUNTING, raw=True, stream=True,
                                 options={**GREEDY, "num_predict": 12, "stop": [" 9"]}))
    assert "".join(p.response for p in parts) == " 6, 7, 8," and parts[-1].done_reason == "stop"


def test_sampling_options_are_applied(client):
    greedy = client.generate(model=MODEL, prompt=COUNTING, raw=True, options={**GREEDY, "num_predict": 8}).response
    # top_k 1 leaves only the most likely token, whatever the temperature
    assert client.generate(model=MODEL, prompt=COUNTING, raw=True,
                           options={"temperature": 1.5, "top_k": 1, "num_predict": 8}).response == greedy
    # a strong repeat penalty pushes away from the digits and commas the prompt is made of
    assert client.generate(model=MODEL, prompt=COUNTING, raw=True,
                           options={**GREEDY, "repeat_penalty": 5.0, "num_predict": 8}).response != greedy
    seeded = {"temperature": 1.0, "seed": 42, "num_predict": 12}
    first = client.generate(model=MODEL, prompt="Tell me a story.", options=seeded).response
    assert client.generate(model=MODEL, prompt="Tell me a story.", options=seeded).response == first


def test_logprobs_score_each_generated_token(client):
    r = client.generate(model=MODEL, prompt=COUNTING, raw=True, logprobs=True, top_logprobs=2,
                        options={**GREEDY, "num_predict": 4})
    assert len(r.logprobs) == r.eval_count == 4
    assert "".join(lp.token for lp in r.logprobs) == r.response
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token for lp in r.logprobs)


def test_an_empty_request_loads_the_model_as_ollama_does(client):
    assert client.generate(model=MODEL).done_reason == "load"
    r = client.chat(model=MODEL, keep_alive="5m")
    assert r.done_reason == "load" and r.message.content == ""


# ---- structured output and tools ----------------------------------------------------------
def test_format_json_answers_an_object(client):
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Describe Tokyo as JSON."}], format="json",
                    options={**GREEDY, "num_predict": 120})
    assert r.done_reason == "stop" and isinstance(json.loads(r.message.content), dict)
    g = client.generate(model=MODEL, prompt="Describe Tokyo as JSON.", format="json",
                        options={**GREEDY, "num_predict": 120})
    assert g.done_reason == "stop" and isinstance(json.loads(g.response), dict)


def test_a_json_schema_format_gets_a_valid_object_streamed_or_not(client):
    question = [{"role": "user", "content": "Describe the capital of Japan as JSON."}]
    schema = {**City.model_json_schema(), "additionalProperties": False}    # else a small model adds keys
    r = client.chat(model=MODEL, messages=question, format=schema,
                    options={**GREEDY, "num_predict": 80})
    assert r.done_reason == "stop", r.message.content
    City.model_validate_json(r.message.content)
    parts = list(client.chat(model=MODEL, messages=question, format=schema, stream=True,
                             options={"temperature": 0.8, "seed": 3, "num_predict": 80}))
    City.model_validate_json("".join(p.message.content for p in parts))


def test_a_tool_call_comes_back_as_tool_calls_and_its_result_is_read(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, messages=question, tools=[WEATHER], format=WEATHER_CALL,
              options={**GREEDY, "num_predict": 40})
    r = client.chat(**kw)
    assert r.message.content == "" and len(r.message.tool_calls) == 1
    call = r.message.tool_calls[0].function
    assert call.name == "get_weather" and set(call.arguments) == {"city"}
    parts = list(client.chat(**kw, stream=True))
    calls = [c.function for p in parts for c in p.message.tool_calls or []]
    assert calls == [call] and not any(p.message.content for p in parts)

    turn = question + [{"role": "assistant", "content": "", "tool_calls": [{"function": call.model_dump()}]},
                       {"role": "tool", "content": "It is 18 C and sunny in Paris.", "tool_name": "get_weather"}]
    answer = client.chat(model=MODEL, messages=turn, tools=[WEATHER], options={**GREEDY, "num_predict": 40})
    assert answer.done_reason == "stop" and not answer.message.tool_calls and "Paris" in answer.message.content


# ---- the model ----------------------------------------------------------------------------
def test_tags_show_ps_and_version_describe_the_one_model(client, server):  # noqa: F811
    [m] = client.list().models
    assert m.model == MODEL and m.size > 0 and re.fullmatch(r"[0-9a-f]{64}", m.digest) and m.modified_at
    assert m.details.family == "llama" and m.details.quantization_level == "BF16"
    assert m.details.parameter_size == "135M"        # SmolLM2-135M

    cfg = resolve_model(MODEL).config
    s = client.show(MODEL)
    info = s.modelinfo
    assert info["general.architecture"] == "llama" and info["llama.context_length"] == MAX_CONTEXT
    assert (info["llama.embedding_length"], info["llama.block_count"], info["llama.attention.head_count"],
            info["llama.attention.head_count_kv"], info["llama.vocab_size"]) == \
           (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size)
    assert round(info["general.parameter_count"] / 1e6) == 135
    assert s.details == m.details and "tools" in s.capabilities and "temperature" in s.parameters
    assert client.show(f"{MODEL}:latest").details == m.details       # the tag Ollama's clients add

    [p] = client.ps().models
    assert (p.model, p.digest, p.context_length) == (MODEL, m.digest, MAX_CONTEXT) and p.expires_at.year == 9999

    status, _, body = _http(server, "GET", "/api/version")
    assert status == 200 and re.fullmatch(r"\d+\.\d+\.\d+", json.loads(body)["version"])


# ---- bad requests -------------------------------------------------------------------------
USER = [{"role": "user", "content": "hi"}]
BAD = [
    ("/api/chat", {"model": "llama3.2", "messages": USER}, 404, "model 'llama3.2' not found"),
    ("/api/generate", {"model": "other:latest", "prompt": "hi"}, 404, "not found"),
    ("/api/show", {"model": "other"}, 404, "not found"),
    ("/api/generate", {"prompt": "hi"}, 400, "'model' is required"),
    ("/api/generate", {"model": 7, "prompt": "hi"}, 400, "'model' must be a string"),
    ("/api/generate", {"model": MODEL, "prompt": ""}, 400, "'prompt' is empty"),
    ("/api/generate", {"model": MODEL, "prompt": "   "}, 400, "'prompt' is empty"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": ""}]}, 400, "needs a user message"),
    ("/api/generate", {"model": MODEL, "prompt": "word " * MAX_CONTEXT}, 400, "maximum context length is 512"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "word " * MAX_CONTEXT}]}, 400,
     "maximum context length"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "options": {"temprature": 0}}, 400,
     "unknown option 'temprature'"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "options": {"mirostat": 2}}, 400, "'mirostat' is not supported"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "options": {"temperature": "hot"}}, 400,
     "'temperature' must be a number"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "options": {"temperature": 9}}, 400, "'temperature' must be"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "options": {"num_predict": 1.5}}, 400,
     "'num_predict' must be an integer"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "options": {"num_predict": 0}}, 400, "'num_predict'"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "options": {"stop": [1]}}, 400, "'stop' must be"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "options": [0]}, 400, "'options' must be an object"),
    ("/api/generate", {"model": MODEL, "prompt": 5}, 400, "'prompt' must be a string"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "'stream' must be true or false"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "raw": 1}, 400, "'raw' must be true or false"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "raw": True, "system": "Be brief."}, 400, "'system'"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "format": "xml"}, 400, "'format' must be"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "format": {"type": "wat"}}, 400, "'format'"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "images": ["aGk="]}, 400, "'images' are not supported"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "think": True}, 400, "does not think"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "template": "{{ .Prompt }}"}, 400, "'template'"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "keep_alive": [5]}, 400, "'keep_alive'"),
    ("/api/chat", {"model": MODEL, "messages": "hi"}, 400, "'messages' must be a non-empty list"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role 'wizard'"),
    ("/api/chat", {"model": MODEL, "messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("/api/chat", b"{not json", 400, "not valid JSON"),
    ("/api/chat", b"[1, 2]", 400, "must be a JSON object"),
    ("/api/pull", {"model": MODEL}, 404, "not found"),
]


@pytest.mark.parametrize("path, body, status, message", BAD)
def test_bad_requests_get_ollama_errors(server, path, body, status, message):  # noqa: F811
    got, headers, raw = _http(server, "POST", path, body)
    assert got == status, raw
    assert headers["content-type"] == "application/json" and b"\n" not in raw.strip()
    err = json.loads(raw)
    assert set(err) == {"error"} and message in err["error"]


def test_the_client_reports_a_refusal_with_its_status(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2", messages=USER)
    assert e.value.status_code == 404 and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        list(client.generate(model=MODEL, prompt="hi", options={"seed": "x"}, stream=True))
    assert e.value.status_code == 400 and "'seed' must be an integer" in e.value.error


def test_a_wrong_method_gets_405_with_allow(server):  # noqa: F811
    status, headers, body = _http(server, "GET", "/api/chat")
    assert status == 405 and headers["allow"] == "POST" and "error" in json.loads(body)
    status, headers, _ = _http(server, "POST", "/api/tags")
    assert status == 405 and headers["allow"] == "GET, HEAD"


def test_bad_requests_leave_the_server_answering(client, server):  # noqa: F811
    assert "Tokyo" in client.chat(model=MODEL, messages=JAPAN, options={**GREEDY, "num_predict": 12}).message.content
    log = server.log()
    assert "Traceback" not in log and " 500" not in log
    assert "POST /api/generate refused: 400: 'prompt' is empty" in log


def test_a_client_that_leaves_a_stream_frees_the_device(client, server):  # noqa: F811
    def cancelled() -> list[str]:
        return [l for l in server.log().splitlines() if "ollama-" in l and "cancelled by client" in l]

    before = len(cancelled())
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/api/generate", json.dumps({"model": MODEL, "prompt": COUNTING, "raw": True,
                                                      "options": {**GREEDY, "num_predict": LONG}}).encode())
    r = conn.getresponse()
    assert json.loads(r.readline())["done"] is False and json.loads(r.readline())["done"] is False
    conn.close()
    client.generate(model=MODEL, prompt="Hi", options={**GREEDY, "num_predict": 2})   # queued behind it
    lines = cancelled()
    assert len(lines) == before + 1
    assert int(re.search(r"(\d+) generated", lines[-1]).group(1)) < LONG, lines[-1]
