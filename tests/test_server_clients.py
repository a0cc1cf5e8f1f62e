"""`make serve` as people's tools meet it: each client library's default way of asking for
structured output or a tool call, the embeddings and the endpoints front ends poll, against a
real server on the embedded model (the module-scoped fixture of tests/test_server.py).

The model is SmolLM2-135M: where a client leaves the answer's shape to the model (a tool the
model may or may not call, a schema shown to it in a system message), the test says what the
model did and holds the server to its part: the answer is what the request allowed.
"""
from __future__ import annotations

import base64
import http.client
import json
import struct

import instructor
import openai
from instructor.core.exceptions import IncompleteOutputException, InstructorRetryException
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from test_server import MODEL, MAX_CONTEXT, server  # noqa: F401 -- the module-scoped server fixture

PEOPLE = ["Alice is 30 and lives in Paris, France.", "Bob, aged 42, has his home in Tokyo, Japan.",
          "Carla is a 25-year-old from Lima, Peru."]


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):
    """Nested: its JSON schema refers to Address through `$defs`."""
    name: str = Field(max_length=20)
    age: int
    home: Address


class Node(BaseModel):
    """Recursive: a `$ref` back to itself."""
    label: str = Field(max_length=10)
    children: list["Node"] = Field(default_factory=list, max_length=2)


def get_weather(city: str) -> str:
    """The weather in a city now."""
    return "sunny"


def _client(server) -> OpenAI:  # noqa: F811
    return OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def _raw(server, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:  # noqa: F811
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request(method, path, json.dumps(body).encode() if body is not None else None,
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# ---- structured output and tools, as each client asks for them by default ----------------

def test_openai_parse_and_pydantic_function_tool_with_a_nested_model(server):  # noqa: F811
    c = _client(server)
    for prompt in PEOPLE:
        msgs = [{"role": "user", "content": prompt}]
        parsed = c.chat.completions.parse(model=MODEL, messages=msgs, response_format=Person, temperature=0,
                                          max_tokens=80).choices[0].message.parsed
        assert isinstance(parsed, Person)
        r = c.chat.completions.create(model=MODEL, messages=msgs, tools=[openai.pydantic_function_tool(Person)],
                                      tool_choice={"type": "function", "function": {"name": "Person"}},
                                      temperature=0, max_tokens=80)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        Person.model_validate_json(call.function.arguments)


def test_a_recursive_model_as_a_required_tool(server):  # noqa: F811
    """Its `$ref` to the root of the parameters resolves inside the call's schema. (Asked for
    a tree with leaves, this model nests nodes until its token budget: the prompt keeps it flat.)"""
    r = _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Make a node called top with no children."}],
        tools=[openai.pydantic_function_tool(Node)], tool_choice="required", temperature=0, max_tokens=120)
    (call,) = r.choices[0].message.tool_calls
    Node.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(server, method):  # noqa: F811
    llm = ChatOpenAI(base_url=server.base_url, api_key="none", model=MODEL, temperature=0, max_tokens=80,
                     max_retries=0)
    for prompt in PEOPLE:
        assert isinstance(llm.with_structured_output(Person, method=method).invoke(prompt), Person)


def test_langchain_bind_tools_under_auto(server):  # noqa: F811
    """bind_tools leaves the choice to the model ("auto"). Asked plainly, this model answers
    in prose (its replies are checked to be text, never a malformed call); shown two calls
    first, it writes one, which comes back as a call whose arguments match the schema."""
    llm = ChatOpenAI(base_url=server.base_url, api_key="none", model=MODEL, temperature=0, max_tokens=60,
                     max_retries=0).bind_tools([get_weather])
    plain = llm.invoke("What is the weather in Paris?")
    assert plain.tool_calls or plain.content.strip()
    shots = [HumanMessage("What is the weather in Rome?"),
             AIMessage('{"name": "get_weather", "parameters": {"city": "Rome"}}'),
             HumanMessage("And in Oslo?"), AIMessage('{"name": "get_weather", "parameters": {"city": "Oslo"}}')]
    for city in ("Paris", "Tokyo", "Lima"):
        m = llm.invoke(shots + [HumanMessage(f"And in {city}?")])
        assert [(c["name"], c["args"]) for c in m.tool_calls] == [("get_weather", {"city": city})]


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_tools_and_json_schema_modes(server, mode):  # noqa: F811
    client = instructor.from_openai(_client(server), mode=mode)
    for prompt in PEOPLE:
        got = client.chat.completions.create(model=MODEL, response_model=Person, max_retries=0, temperature=0,
                                             max_tokens=80, messages=[{"role": "user", "content": prompt}])
        assert isinstance(got, Person)


def test_instructor_json_mode_gets_json_objects_the_model_fills_wrongly(server):  # noqa: F811
    """Mode.JSON asks only for "a JSON object" and shows the schema in a system message: the
    server holds the answer to an object, and this model copies the schema instead of filling it
    in. The server's part: every answer is a JSON object."""
    client = instructor.from_openai(_client(server), mode=instructor.Mode.JSON)
    for prompt in PEOPLE:
        try:
            got, _ = client.chat.completions.create_with_completion(
                model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=200,
                messages=[{"role": "user", "content": prompt}])
            assert isinstance(got, Person)
        except (InstructorRetryException, IncompleteOutputException) as e:
            raw = getattr(e, "last_completion", None)
            if raw is not None and raw.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(raw.choices[0].message.content), dict)


# ---- the schema path --------------------------------------------------------------------

def test_an_open_object_schema_admits_no_keys_it_does_not_list(server):  # noqa: F811
    """No additionalProperties stated: closed, so the answer has exactly the listed keys, and
    the model cannot run on adding keys; one that states them open keeps them allowed."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    r = _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a city in Japan as JSON with many details."}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"city"}


def test_under_auto_a_call_whose_arguments_break_the_schema_is_text(server):  # noqa: F811
    """The model is shown a call with a city longer than the schema allows; repeating it, its
    answer is returned as text (finish "stop"), not as a call the client would trust."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}}}
    call = '{"name": "get_weather", "parameters": {"city": "Constantinople"}}'
    msgs = [{"role": "user", "content": "Weather in Constantinople?"}, {"role": "assistant", "content": call},
            {"role": "user", "content": "Weather in Constantinople?"}]
    r = _client(server).chat.completions.create(model=MODEL, messages=msgs, tools=[tool], temperature=0,
                                                max_tokens=40)
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert json.loads(choice.message.content)["parameters"]["city"] == "Constantinople"


# ---- embeddings and the local endpoints --------------------------------------------------

def test_embeddings_float_and_base64_through_the_openai_client(server):  # noqa: F811
    c = _client(server)
    texts = ["The cat sat on the mat.", "A kitten rested on the rug.", "Quarterly revenue grew by nine percent."]
    got = c.embeddings.create(model=MODEL, input=texts)                 # the client asks for base64
    vecs = [d.embedding for d in got.data]
    assert [d.index for d in got.data] == [0, 1, 2] and got.usage.prompt_tokens > 0
    assert all(abs(sum(x * x for x in v) - 1) < 1e-3 for v in vecs)
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))
    assert dot(vecs[0], vecs[1]) > dot(vecs[0], vecs[2])               # alike texts are closer
    floats = c.embeddings.create(model=MODEL, input=texts[0], encoding_format="float").data[0].embedding
    assert floats == pytest.approx(vecs[0], abs=1e-6)
    status, body = _raw(server, "POST", "/v1/embeddings", {"model": MODEL, "input": texts[0],
                                                           "encoding_format": "base64"})
    packed = base64.b64decode(json.loads(body)["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(floats, abs=1e-6)


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["ok", "  "]}, "input[1]"),
    ({"input": "x" * (8 * MAX_CONTEXT)}, "input"), ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "dimensions": 3}, "dimensions"), ({"input": [[-1]]}, "input")])
def test_a_bad_embeddings_request_is_a_400_and_the_server_goes_on(server, body, param):  # noqa: F811
    status, raw = _raw(server, "POST", "/v1/embeddings", {"model": MODEL, **body})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param and "\n" not in err["message"]
    assert _raw(server, "GET", "/health")[0] == 200


def test_health_tokenize_and_detokenize(server):  # noqa: F811
    status, raw = _raw(server, "GET", "/health")
    health = json.loads(raw)
    assert status == 200 and health["status"] in ("ready", "busy") and health["model"] == MODEL
    assert "simulated" in health["device"] and health["context"] == MAX_CONTEXT
    ids = json.loads(_raw(server, "POST", "/tokenize", {"content": "Hello world"})[1])["tokens"]
    pieces = json.loads(_raw(server, "POST", "/tokenize", {"content": "Hello world", "with_pieces": True})[1])
    assert [p["id"] for p in pieces["tokens"]] == ids and "".join(p["piece"] for p in pieces["tokens"]) == "Hello world"
    special = json.loads(_raw(server, "POST", "/tokenize", {"content": "Hello world", "add_special": True})[1])
    assert len(special["tokens"]) >= len(ids)
    assert json.loads(_raw(server, "POST", "/detokenize", {"tokens": ids})[1]) == {"content": "Hello world"}
    assert _raw(server, "POST", "/tokenize", {"content": 3})[0] == 400
    assert _raw(server, "POST", "/detokenize", {"tokens": [10 ** 9]})[0] == 400


def _samples(server) -> dict[tuple[str, tuple], float]:  # noqa: F811
    status, raw = _raw(server, "GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(raw.decode()) for s in fam.samples}


def test_metrics_count_requests_tokens_and_answers(server):  # noqa: F811
    before = _samples(server)
    _client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            temperature=0, max_tokens=5)
    _raw(server, "POST", "/v1/embeddings", {"model": MODEL, "input": ""})
    after = _samples(server)
    key = lambda route, status: ("llama_npu_requests_total", (("route", route), ("status", status)))
    assert after[key("/v1/chat/completions", "200")] == before.get(key("/v1/chat/completions", "200"), 0) + 1
    assert after[key("/v1/embeddings", "400")] == before.get(key("/v1/embeddings", "400"), 0) + 1
    grown = after[("llama_npu_completion_tokens_total", ())] - before[("llama_npu_completion_tokens_total", ())]
    assert 1 <= grown <= 5
    assert after[("llama_npu_ttft_seconds_count", ())] == before[("llama_npu_ttft_seconds_count", ())] + 1
    assert ("llama_npu_queue_depth", ()) in after and ("llama_npu_busy", ()) in after
