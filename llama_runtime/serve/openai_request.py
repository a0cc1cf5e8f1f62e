"""Reading an OpenAI API request the way OpenAI does: the same checks, the same error body
({"error": {message, type, param, code}}) and status codes, so that clients written against
OpenAI report our refusals as they would report theirs. `app` routes; this module only
judges a request's fields.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from llama_base.errors import UserError
from llama_runtime.generation.constrained import ANY_OBJECT
from llama_runtime.text.chat_format import CHAT_ROLES

MAX_TEMPERATURE = 2.0      # OpenAI's range for `temperature`
DEFAULT_TEMPERATURE = 1.0  # and its default: clients that want greedy answers send 0
MAX_STOP_STRINGS = 4       # and for `stop`
MAX_LOGIT_BIAS = 100.0     # OpenAI's range for a `logit_bias` value is [-100, 100]
SYSTEM_ROLES = ("system", "developer")     # OpenAI's newer name for the system role
MESSAGE_ROLES = SYSTEM_ROLES + CHAT_ROLES   # what the chat format renders


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def json_body(request: Request) -> dict:
    return json_object(await request.body())


def json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object, else OpenAI's 400."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def int_param(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(v)}", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def number_param(body: dict, name: str, default: float, ok: Callable[[float], bool], rule: str) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {json.dumps(v)}", name)
    if not ok(v):
        raise ApiError(400, f"'{name}' must be {rule}, got {v}", name)
    return float(v)


def bool_param(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {json.dumps(v)}", name)
    return v


def stop_strings(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop")
    return tuple(s for s in items if s)


def refuse_unsupported(body: dict) -> None:
    """Refuse, rather than silently ignore, options that would change the answer."""
    for name in ("n", "best_of"):
        n = int_param(body, name, 1, sys.maxsize)
        if n is not None and n != 1:
            raise ApiError(400, f"only {name}=1 is supported (one model, one answer at a time), got {n}", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if number_param(body, name, 0.0, lambda x: True, "") != 0:
            raise ApiError(400, f"'{name}' is not supported; leave it at 0", name)


def logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs: OpenAI's map of token id (a JSON string key)
    to a bias in [-100, 100], added to that token's logit before sampling."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise ApiError(400, "'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out = []
    for key, bias in v.items():
        try:
            tid = int(key)
        except ValueError:
            tid = -1
        if not 0 <= tid < vocab_size or str(tid) != key.strip():
            raise ApiError(400, f"'logit_bias': {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                           "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ApiError(400, f"'logit_bias': the bias of token {tid} must be a number between "
                           f"{-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {json.dumps(bias)}", "logit_bias")
        out.append((tid, float(bias)))
    return tuple(out)


def _text(m: dict, i: int) -> str:
    content = m.get("content")
    if content is None and m["role"] == "assistant" and m.get("tool_calls"):
        return ""                           # the calls themselves are rendered by the caller
    if isinstance(content, list):      # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be text", f"messages[{i}].content")
    return content


def _tool_calls_text(m: dict, i: int) -> str:
    """An earlier answer's tool calls as the model would have written them: one JSON object
    {"name", "parameters"} per call, Llama 3.2's format for a call."""
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}] needs a function with a name",
                           f"messages[{i}].tool_calls[{j}]")
        args = f.get("arguments") or "{}"
        try:
            params = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                           f"messages[{i}].tool_calls[{j}].function.arguments") from None
        out.append(json.dumps({"name": f["name"], "parameters": params}, ensure_ascii=False))
    return "\n".join(out)


def chat_messages(messages: Any) -> list[dict]:
    """OpenAI messages as the chat format takes them: role and plain-text content.

    The chat formats have one system block, before the first turn. So the `system` and
    `developer` messages that open a conversation are joined into it (blank line between), and
    one after the first turn is refused rather than moved, since moving it changes its meaning.
    """
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    system: list[str] = []
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        if m["role"] not in MESSAGE_ROLES:
            raise ApiError(400, f"messages[{i}]: role {m['role']!r} is not supported; the roles are "
                           f"{', '.join(MESSAGE_ROLES)} (system or developer first, if at all)", f"messages[{i}].role")
        content = _text(m, i)
        if m["role"] in SYSTEM_ROLES:
            if out:
                raise ApiError(400, f"messages[{i}]: a {m['role']} message must come before the first user or "
                               "assistant message (the chat format has one system block, at the start)",
                               f"messages[{i}].role")
            system.append(content)
            continue
        if m["role"] == "assistant" and m.get("tool_calls"):
            content = "\n".join(t for t in (content, _tool_calls_text(m, i)) if t)
        out.append({"role": m["role"], "content": content})
    if not any(m["content"].strip() for m in out if m["role"] == "user"):
        raise ApiError(400, "'messages' needs a user message with some text", "messages")
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + out


def response_format_schema(rf: Any) -> tuple[dict, str] | None:
    """The JSON schema `response_format` asks for and the field it sits in (None for plain
    text), or a 400 naming the field that is wrong."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return ANY_OBJECT, "response_format"
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "'response_format.json_schema' must be an object with a 'schema'",
                       "response_format.json_schema")
    schema = spec.get("schema", ANY_OBJECT)
    if not isinstance(schema, dict):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                       "response_format.json_schema.schema")
    return schema, "response_format.json_schema.schema"


T = TypeVar("T")


def as_request_error(fn: Callable[[], T], param: str) -> T:
    """`fn()`, its bad-input error (a `UserError`) answered as a 400 naming `param`."""
    try:
        return fn()
    except UserError as e:
        raise ApiError(400, str(e), param) from None


def internal_error(e: BaseException) -> ApiError:
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", None, None, "server_error")


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", None, "shutting_down", "server_error")


def as_api_error(e: BaseException) -> ApiError:
    """What a failed job reports: the runtime's refusals are the request's fault, the rest ours."""
    if isinstance(e, ApiError):
        return e
    return ApiError(400, str(e)) if isinstance(e, UserError) else internal_error(e)
