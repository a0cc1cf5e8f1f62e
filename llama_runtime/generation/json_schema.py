"""The one path a JSON schema takes before it becomes a grammar or judges an answer: a request's
`response_format`, a tool's `parameters`, the command line's `--json-schema`.

Two rules that clients' schemas need and that JSON Schema itself leaves open:

- **Closed objects.** An object schema that lists its `properties` and says nothing about
  other keys admits any other key, any number of times. A grammar built from it lets a small
  model add keys until its token budget runs out, and nothing parses (LangChain's `bind_tools`,
  instructor's JSON mode and `llm --schema` all send such schemas). So such an object is taken
  as closed, `additionalProperties: false`, as llama.cpp's schema converter takes it. A schema
  that states `additionalProperties` (true, or a schema for the extra values), or
  `patternProperties` / `unevaluatedProperties`, keeps what it states; `{"type": "object"}`
  with no properties stays any object. An `allOf` and its members are left open: each member
  lists only its own part of the keys, and closing them would leave no object that matches all.
- **Embedded schemas keep their references.** A tool's parameters are one part of the schema
  of a whole call ({"name": ..., "parameters": ...}), but their `$ref`s ("#/$defs/Address",
  or "#" for a recursive model) point into the parameters' own root. `embed` moves the schema
  under the call's `$defs` and rewrites each local reference to point there, so nested and
  recursive Pydantic models (instructor's tools mode, `openai.pydantic_function_tool`) compile
  as they do as a `response_format`.

Answers are judged with the same closed schema (`violation`), by `jsonschema`, so a call the
model writes under `tool_choice: "auto"` is held to what a required call's grammar enforces.
"""
from __future__ import annotations

import copy
from typing import Any

import jsonschema
from referencing.exceptions import Unresolvable

DATA_KEYWORDS = ("enum", "const", "default", "examples")   # values, not schemas: never rewritten
OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: Any) -> Any:
    """A copy of `schema` whose objects with stated properties admit no others, unless it says so."""
    return _close(copy.deepcopy(schema), True)


def _close(node: Any, here: bool) -> Any:
    if isinstance(node, list):
        for item in node:
            _close(item, True)
        return node
    if not isinstance(node, dict):
        return node
    if (here and isinstance(node.get("properties"), dict) and "allOf" not in node
            and not any(k in node for k in OPEN_KEYWORDS)):
        if node.get("type", "object") == "object" or (isinstance(node.get("type"), list) and "object" in node["type"]):
            node["additionalProperties"] = False
    for key, value in node.items():
        if key in DATA_KEYWORDS:
            continue
        if key == "allOf" and isinstance(value, list):
            for part in value:
                _close(part, False)
        elif key == "properties" and isinstance(value, dict):
            for sub in value.values():
                _close(sub, True)
        else:
            _close(value, True)
    return node


def embed(schema: dict, name: str) -> tuple[dict, dict]:
    """`schema` as a part of a larger one: ({"$ref": "#/$defs/<name>"}, the `$defs` entry the
    larger schema must carry), every local reference in it rewritten to its new place."""
    at = f"#/$defs/{name}"
    return {"$ref": at}, {name: _rebase(copy.deepcopy(schema), at)}


def _rebase(node: Any, at: str) -> Any:
    if isinstance(node, list):
        return [_rebase(item, at) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = at + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebase(value, at)
    return out


def violation(schema: dict, value: Any) -> str | None:
    """Why `value` does not match `schema` (closed as the grammar would close it), in one line;
    None when it matches."""
    try:
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator.check_schema(schema)
        error = jsonschema.exceptions.best_match(validator(closed(schema)).iter_errors(value))
    except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.UnknownType, Unresolvable, TypeError) as e:
        return f"the schema cannot judge it: {str(e).splitlines()[0]}"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{'at ' + where + ': ' if where else ''}{error.message}"[:300]
