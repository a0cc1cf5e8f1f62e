"""Tools without a server: how each chat format shows them to the model, and how an answer
becomes an OpenAI tool call."""
from __future__ import annotations

import datetime
import json

import pytest

from llama_base.config import LlamaConfig
from llama_runtime.checkpoints import builtin
from llama_runtime.text.chat_format import GENERIC_TOOLS_INTRO, Llama3ChatFormat
from llama_runtime.serve.openai_request import ApiError
from llama_runtime.text.tokenizer import Tokenizer
from llama_runtime.serve.events import TextPiece, ToolCall
from llama_runtime.serve.tool_calls import CallHold, tool_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TURNS = [{"role": "user", "content": "  Weather in Paris?  "},
         {"role": "assistant", "content": '{"name": "get_weather", "parameters": {"city": "Paris"}}'},
         {"role": "tool", "content": "18 C"}]


@pytest.fixture(scope="module")
def llama():
    return Tokenizer(builtin.llama_tokenizer_dir(), LlamaConfig(), today=datetime.date(2024, 7, 26))


@pytest.fixture(scope="module")
def smol():
    return Tokenizer(builtin.ensure_embedded_model())


def test_llama3_puts_tools_in_the_first_user_message_and_results_in_ipython(llama):
    assert isinstance(llama.chat, Llama3ChatFormat)
    text = llama.decode(llama.chat.render(TURNS, tools=[WEATHER]))
    listing = json.dumps(WEATHER, indent=4)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                           "Cutting Knowledge Date:")
    assert ("<|start_header_id|>user<|end_header_id|>\n\n" + Llama3ChatFormat.TOOLS_INTRO + listing
            + "\n\nWeather in Paris?<|eot_id|>") in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "ipython" not in llama.decode(llama.chat.render(TURNS[:1]))    # no tools, no environment line


def test_a_format_without_tools_gets_them_in_the_system_text(smol):
    text = smol.decode(smol.chat.render([{"role": "system", "content": "Be brief."}] + TURNS, tools=[WEATHER, TIME]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + GENERIC_TOOLS_INTRO + json.dumps(WEATHER, indent=4)
                           + "\n\n" + json.dumps(TIME, indent=4) + "<|im_end|>\n")
    assert "<|im_start|>tool\n18 C<|im_end|>" in text


def test_answers_become_calls_only_when_they_call_an_offered_function():
    req = tool_request({"tools": [WEATHER, TIME]})
    call = req.as_call('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert req.as_call('{"name": "get_time", "arguments": {}}')["function"]["arguments"] == "{}"
    for text in ('{"name": "launch", "parameters": {}}', "Paris is sunny.", '{"name": "get_time", "parameters": 3}',
                 '[{"name": "get_time"}]'):
        assert req.as_call(text) is None, text


def test_tool_choice_decides_the_schema():
    assert tool_request({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert tool_request({"tools": [WEATHER, TIME]}).schema() is None          # auto: text or a call
    both = tool_request({"tools": [WEATHER, TIME], "tool_choice": "required"}).schema()
    assert [s["properties"]["name"]["const"] for s in both["anyOf"]] == ["get_weather", "get_time"]
    one = tool_request({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert one.schema()["properties"]["name"] == {"const": "get_time"}
    with pytest.raises(ApiError) as e:
        tool_request({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert e.value.param == "tool_choice"


def _hold(pieces: list[str], complete: bool):
    """What a streamed answer shows, piece by piece, then at its end."""
    hold = CallHold(tool_request({"tools": [WEATHER, TIME]}))
    shown = [hold.push(TextPiece(p, [])) for p in pieces]
    return shown, hold.finish(complete)


def test_a_streamed_answer_is_held_while_it_may_be_a_call_and_ends_as_one():
    shown, last = _hold([" ", '{"name": "get_time",', ' "parameters": {}}'], complete=True)
    assert shown == [None, None, None]
    assert isinstance(last, ToolCall) and last.call["function"] == {"name": "get_time", "arguments": "{}"}


def test_text_is_released_once_it_cannot_be_a_call_and_a_cut_call_stays_text():
    shown, last = _hold(["  ", "It is", " sunny."], complete=True)
    assert shown == [None, TextPiece("  It is", []), TextPiece(" sunny.", [])] and last is None
    cut = '{"name": "get_time", "param'
    shown, last = _hold([cut], complete=False)          # the token budget ended it mid-call
    assert shown == [None] and last == TextPiece(cut, [])
