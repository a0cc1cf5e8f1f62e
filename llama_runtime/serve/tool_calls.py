"""OpenAI function calling on a model that writes a call as one JSON object,
{"name": ..., "parameters": {...}}, as Llama 3.2 does (chat_format.py tells the model so).

`tool_choice` decides what the answer may be: "none" offers no tools; "auto" lets the model
answer in text or with a call, and an answer that parses as a call of an offered function,
with arguments that match its parameters' schema, becomes `tool_calls` (one that does not is
returned as the text it is, finish_reason "stop"); "required" and a named function constrain
decoding to a call (of any offered function, or of that one) with arguments that match the
function's parameter schema, through the same grammar mask as `response_format`. Every
function's schema must compile into that grammar, whatever the choice.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from llama_runtime.generation.constrained import json_grammar
from llama_runtime.generation.json_schema import embed, violation
from llama_runtime.serve.events import TextPiece, ToolCall
from llama_runtime.serve.openai_request import ApiError, as_request_error

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolRequest:
    tools: list[dict]          # the request's entries, as the chat format shows them to the model
    choice: str                # "auto" | "required" | a function's name (never "none": no request then)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict:
        f = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return f.get("parameters") or EMPTY_PARAMETERS

    def schema(self) -> dict | None:
        """The JSON schema an answer must match, or None when the model may also answer in text.
        Each function's parameters sit under the call's `$defs`, their references rewritten to
        point there (`json_schema.embed`)."""
        if self.choice == "auto":
            return None
        calls, defs = [], {}
        for i, name in enumerate(n for n in self.names if self.choice in ("required", n)):
            ref, entry = embed(self.parameters(name), f"parameters_{i}")
            defs.update(entry)
            calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": ref},
                          "required": ["name", "parameters"], "additionalProperties": False})
        return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "$defs": defs}

    def as_call(self, text: str) -> dict | None:
        """`text` as an OpenAI tool call, if it is exactly one call of an offered function with
        arguments its parameters' schema accepts (closed as a required call's grammar closes it);
        anything else is the answer's text."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("parameters", obj.get("arguments", {}))
        if not isinstance(args, dict) or violation(self.parameters(obj["name"]), args) is not None:
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class CallHold:
    """An answer's text, held back while it may still be a call: from its start, while it is
    blank or begins with "{", to its end if it does. Then it is a `ToolCall` if it parses as
    one, else the text it held."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.holding, self.held = True, TextPiece("", [])

    def push(self, piece: TextPiece) -> TextPiece | None:
        """What may be shown now: `piece`, everything held so far, or None (still holding)."""
        if not self.holding:
            return piece
        self.held = TextPiece(self.held.text + piece.text, self.held.logprobs + piece.logprobs)
        if self.held.text.lstrip()[:1] in ("", "{"):
            return None
        self.holding = False
        return self.held

    def finish(self, complete: bool) -> TextPiece | ToolCall | None:
        """What is still held when the answer ends; only a `complete` answer (one that ended
        itself, not at the token budget) can be a call."""
        if not self.holding:
            return None
        self.holding = False
        call = self.request.as_call(self.held.text.strip()) if complete else None
        if call is not None:
            return ToolCall(call, self.held.logprobs)
        return self.held if self.held.text or self.held.logprobs else None


def tool_request(body: dict) -> ToolRequest | None:
    """`tools` and `tool_choice` checked as OpenAI checks them; None when no tool is offered."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") or body.get("function_call"):
        raise ApiError(400, "'functions' and 'function_call' are deprecated; use 'tools' and 'tool_choice'",
                       "functions")
    if not tools:
        if choice is not None:
            raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", "tools")
    seen = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           f"tools[{i}]")
        if name in seen:
            raise ApiError(400, f"tools[{i}]: the function name {name!r} is used twice", f"tools[{i}].function.name")
        seen.add(name)
        params, where = f.get("parameters"), f"tools[{i}].function.parameters"
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"{where} must be a JSON schema object", where)
        if params:                      # refused now, even under "auto", where no grammar is built
            as_request_error(lambda: json_grammar(params, where), where)
    choice = _choice(choice, seen)
    return None if choice == "none" else ToolRequest(tools, choice)


def _choice(choice: Any, names: set[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    f = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise ApiError(400, f"'tool_choice' names {name!r}, which is not among the tools", "tool_choice")
    return name
