"""The one schema path (generation/json_schema.py) without a server: which objects it closes and
which it leaves open, how a tool's parameters keep their references inside a call's schema,
and what the grammar then admits, tested with the embedded model's tokenizer and llguidance."""
from __future__ import annotations

import copy

import jsonschema
import pytest

from llama_runtime.checkpoints import builtin
from llama_runtime.generation.constrained import GrammarError, Grammars, json_grammar
from llama_runtime.generation.json_schema import closed, embed, violation
from llama_runtime.serve.openai_request import ApiError
from llama_runtime.serve.tool_calls import tool_request
from llama_runtime.text.tokenizer import Tokenizer

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x"]}
# A nested and a recursive Pydantic-style model: references into the schema's own root.
ADDRESS = {"$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
           "type": "object", "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"}},
           "required": ["name", "home"]}
NODE = {"type": "object", "properties": {"name": {"type": "string"},
                                         "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["name", "children"]}


def test_objects_with_stated_properties_are_closed_wherever_they_sit():
    schema = {"type": "object", "properties": {
        "point": POINT,
        "points": {"type": "array", "items": POINT},
        "either": {"anyOf": [POINT, {"type": "null"}]}},
        "$defs": {"P": POINT}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["point"]["additionalProperties"] is False
    assert props["points"]["items"]["additionalProperties"] is False
    either = props["either"]["anyOf"]
    assert either[0]["additionalProperties"] is False and "additionalProperties" not in either[1]
    assert out["$defs"]["P"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in POINT    # copies only


@pytest.mark.parametrize("schema", [
    {**POINT, "additionalProperties": True},
    {**POINT, "additionalProperties": {"type": "string"}},
    {**POINT, "patternProperties": {"^z": {"type": "integer"}}},
    {**POINT, "unevaluatedProperties": False},
    {"type": "object"},                                        # any object, as it says
    {"type": "object", "properties": {"a": {"type": "string"}}, "allOf": [{"required": ["a"]}]},
])
def test_a_schema_that_says_what_other_keys_may_do_keeps_it(schema):
    assert closed(schema) == schema


def test_allof_members_stay_open_so_their_union_still_matches():
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert closed(schema) == schema
    assert violation(schema, {"a": 1, "b": 2}) is None


def test_values_are_never_taken_for_schemas():
    schema = {"const": {"properties": {"a": 1}, "$ref": "#"}, "enum": [{"properties": {}}]}
    assert closed(schema) == schema
    ref, defs = embed(schema, "p")
    assert defs["p"] == schema


def test_embedding_rebases_local_references_and_leaves_others():
    ref, defs = embed({"properties": {"a": {"$ref": "#/$defs/A"}, "b": {"$ref": "#"},
                                      "c": {"$ref": "https://example.com/s.json"}}}, "parameters_0")
    assert ref == {"$ref": "#/$defs/parameters_0"}
    props = defs["parameters_0"]["properties"]
    assert props["a"]["$ref"] == "#/$defs/parameters_0/$defs/A"
    assert props["b"]["$ref"] == "#/$defs/parameters_0"
    assert props["c"]["$ref"] == "https://example.com/s.json"


@pytest.mark.parametrize("params, good, bad", [
    (ADDRESS, {"name": "Ann", "home": {"city": "Oslo"}}, {"name": "Ann", "home": {"city": "Oslo", "zip": "1"}}),
    (NODE, {"name": "top", "children": [{"name": "leaf", "children": []}]},
     {"name": "top", "children": [{"name": "leaf"}]}),
])
def test_a_call_schema_judges_nested_and_recursive_parameters_as_they_stand_alone(params, good, bad):
    tools = tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
                          "tool_choice": "required"})
    schema = tools.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert violation(schema, {"name": "f", "parameters": good}) is None
    assert violation(schema, {"name": "f", "parameters": bad}) is not None
    assert violation(params, good) is None and violation(params, bad) is not None
    json_grammar(schema, "tools")                  # compiles: the references resolve


def test_violations_say_where_in_one_line():
    why = violation(POINT, {"x": 1, "z": 2})
    assert "\n" not in why and "z" in why
    assert violation(POINT, {"x": "one"}).startswith("at x: ")
    assert violation({"type": "nonsense"}, {}).startswith("the schema cannot judge it")


def test_auto_calls_whose_arguments_break_the_schema_stay_text():
    req = tool_request({"tools": [{"type": "function", "function": {"name": "where", "parameters": ADDRESS}}]})
    assert req.as_call('{"name": "where", "parameters": {"name": "Ann", "home": {"city": "Oslo"}}}') is not None
    for args in ('{"name": "Ann"}', '{"name": "Ann", "home": {"city": 3}}',
                 '{"name": "Ann", "home": {"city": "Oslo"}, "extra": 1}'):
        assert req.as_call('{"name": "where", "parameters": ' + args + "}") is None, args


def test_a_broken_reference_is_a_grammar_error_naming_the_field():
    with pytest.raises(GrammarError) as e:
        json_grammar({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "response_format")
    assert e.value.param == "response_format" and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def grammars():
    return Grammars(Tokenizer(builtin.ensure_embedded_model()))


def _admits(grammars, schema: dict, text: str) -> bool:
    """Whether the grammar of `schema` lets the model write `text` and then end."""
    constraint = grammars.for_schema(schema, "test")
    tokenizer = grammars._tokenizer
    for token in tokenizer.encode_text(text):
        if not constraint.allowed()[token]:
            return False
        constraint.consume(token)
    return bool(constraint.allowed()[sorted(tokenizer.end_token_ids)].any())


def test_the_grammar_admits_no_unstated_key_and_no_repeated_one(grammars):
    assert _admits(grammars, POINT, '{"x":1,"y":2}')
    assert not _admits(grammars, POINT, '{"x":1,"z":2}')
    assert not _admits(grammars, POINT, '{"x":1,"x":2}')
    assert _admits(grammars, {**POINT, "additionalProperties": True}, '{"x":1,"z":2}')


def test_the_grammar_of_a_recursive_call_admits_a_tree(grammars):
    tool = {"type": "function", "function": {"name": "make", "parameters": copy.deepcopy(NODE)}}
    schema = tool_request({"tools": [tool], "tool_choice": "required"}).schema()
    tree = '{"name":"make","parameters":{"name":"top","children":[{"name":"leaf","children":[]}]}}'
    assert _admits(grammars, schema, tree)
    assert not _admits(grammars, schema, tree.replace('"children":[]', '"children":[],"x":1'))


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_tool_schema_that_cannot_compile_is_refused_whatever_the_choice(choice):
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}
    tools = [{"type": "function", "function": {"name": "ok", "parameters": POINT}},
             {"type": "function", "function": {"name": "f", "parameters": bad}}]
    with pytest.raises(ApiError) as e:
        tool_request({"tools": tools, "tool_choice": choice})
    assert e.value.status == 400 and e.value.param == "tools[1].function.parameters"
