"""`make serve`: an OpenAI-compatible HTTP API (`/v1/models`, `/v1/chat/completions`,
`/v1/completions`) in front of one session.

Clients of local runtimes speak OpenAI's API, so this module only translates: it checks a
request the way OpenAI would (same error body, same status codes), turns it into prompt
token ids, and hands a `Job` to the `Worker` (serve_worker.py), which owns the model.
Everything here runs on the event loop and never generates; streamed answers are
server-sent events in OpenAI's chunk format, closed by `data: [DONE]`.

`llama32_1b_inference.serve_main` calls `serve(build_session, argv)`: the session builder
sits above this package and is handed down, as with `cli.run_cli`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from llama_base.errors import UserError
from llama_runtime.cli import positive_int, user_error
from llama_runtime.sampling import SamplingParams
from llama_runtime.serve_worker import DEFAULT_QUEUE_SIZE, Job, QueueFull, Worker
from llama_runtime.tokenizer import CHAT_ROLES
from npu_runtime.devices import DEVICE_KINDS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MAX_TEMPERATURE = 2.0      # OpenAI's range for `temperature`
DEFAULT_TEMPERATURE = 1.0  # and its default: clients that want greedy answers send 0
MAX_STOP_STRINGS = 4       # and for `stop`
MESSAGE_ROLES = ("system",) + CHAT_ROLES   # what the chat format renders
SHUTDOWN_GRACE_S = 5       # in-flight answers are cancelled at once; this bounds their goodbye


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# ---- reading a request ----------------------------------------------------------------------
async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(v)}", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _number(body: dict, name: str, default: float, ok: Callable[[float], bool], rule: str) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {json.dumps(v)}", name)
    if not ok(v):
        raise ApiError(400, f"'{name}' must be {rule}, got {v}", name)
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {json.dumps(v)}", name)
    return v


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop")
    return tuple(s for s in items if s)


def _unsupported(body: dict) -> None:
    """Refuse, rather than silently ignore, options that would change the answer."""
    n = _int(body, "n", 1, sys.maxsize)
    if n is not None and n != 1:
        raise ApiError(400, f"only n=1 is supported (one model, one answer at a time), got {n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, lambda x: True, "") != 0:
            raise ApiError(400, f"'{name}' is not supported; leave it at 0", name)
    if body.get("logprobs") not in (None, False, 0):
        raise ApiError(400, "'logprobs' is not supported", "logprobs")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tools and function calling are not supported", "tools")


class Api:
    """The routes, bound to one worker and its session."""

    def __init__(self, worker: Worker, model_id: str):
        self.worker = worker
        self.session = worker.session
        self.model_id = model_id
        self.created = int(time.time())

    # ---- shared by both completion routes ----
    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required and must be a string", "model")
        if model != self.model_id:
            raise ApiError(404, f"the model '{model}' does not exist; this server runs '{self.model_id}'",
                           "model", "model_not_found")

    def _job(self, body: dict, ids: list[int], prompt_param: str) -> Job:
        limit = self.worker.max_context
        if len(ids) >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens, and the prompt has "
                           f"{len(ids)} tokens, leaving no room for an answer", prompt_param, "context_length_exceeded")
        newer, older = _int(body, "max_completion_tokens", 1, limit), _int(body, "max_tokens", 1, limit)
        max_tokens = older if newer is None else newer
        room = limit - len(ids)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        temperature = _number(body, "temperature", DEFAULT_TEMPERATURE, lambda t: 0 <= t <= MAX_TEMPERATURE,
                              f"between 0 and {MAX_TEMPERATURE:g}")
        top_p = _number(body, "top_p", 1.0, lambda p: 0 < p <= 1, "in (0, 1]")
        seed = _int(body, "seed", -sys.maxsize - 1, sys.maxsize)
        sampling = SamplingParams(temperature, 0, top_p, 1.0, seed)
        return Job(ids, max_tokens, sampling, _stops(body), asyncio.get_running_loop())

    def _stream_flags(self, body: dict) -> tuple[bool, bool]:
        stream = _bool(body, "stream")
        opts = body.get("stream_options")
        if opts is None:
            return stream, False
        if not isinstance(opts, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed with stream=true", "stream_options")
        return stream, _bool(opts, "include_usage")

    def _submit(self, job: Job) -> Job:
        try:
            return self.worker.submit(job)
        except QueueFull as e:
            raise ApiError(503, str(e), None, "server_busy", "server_error",
                           {"Retry-After": str(e.retry_after_s)}) from None

    @staticmethod
    def _usage(out) -> dict:
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}

    async def _answer(self, request: Request, job: Job, stream: bool, include_usage: bool,
                      kind: str, choice: Callable[[str, str | None, bool], dict]):
        """Run `job` and answer as one JSON object or as server-sent events. `choice(text,
        finish_reason, streaming)` shapes one choice for this route."""
        rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_id}
        job.id = rid                    # the log line names the id the client sees
        self._submit(job)
        if stream:
            return StreamingResponse(self._events(job, head, include_usage, choice), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = await self._outcome(request, job)
        if out is None:                 # the client left; nobody reads this
            return JSONResponse({}, status_code=499)
        return JSONResponse({**head, "choices": [choice(out.text, out.finish_reason, False)],
                             "usage": self._usage(out), "system_fingerprint": None})

    async def _outcome(self, request: Request, job: Job):
        """The finished job, or None if the client disconnected first (the job is then cancelled)."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    job.cancel("client")
                    return None
                what, value = get.result()
                if what == "error":
                    raise _as_api_error(value)
                if what == "done":
                    if value.cancelled_by == "shutdown":
                        raise _shutting_down()
                    return value
        finally:
            gone.cancel()

    async def _events(self, job: Job, head: dict, include_usage: bool, choice):
        chunk_kind = "chat.completion.chunk" if head["object"] == "chat.completion" else head["object"]
        head = {**head, "object": chunk_kind, "system_fingerprint": None}
        extra = {"usage": None} if include_usage else {}

        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if chunk_kind == "chat.completion.chunk":
                yield sse({**head, "choices": [choice("", None, True) | {"delta": {"role": "assistant", "content": ""}}],
                           **extra})
            while True:
                what, value = await job.events.get()
                if what == "text":
                    yield sse({**head, "choices": [choice(value, None, True)], **extra})
                    continue
                if what == "error":
                    yield sse(_as_api_error(value).body())
                elif value.cancelled_by is not None:
                    yield sse(_shutting_down().body())
                else:
                    yield sse({**head, "choices": [choice("", value.finish_reason, True)], **extra})
                    if include_usage:
                        yield sse({**head, "choices": [], "usage": self._usage(value)})
                yield "data: [DONE]\n\n"
                return
        finally:
            job.cancel("client")        # a no-op once the job is done; else the client has gone

    # ---- routes ----
    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "llama32-1b-npu"}]})

    async def chat_completions(self, request: Request):
        body = await _json_body(request)
        self._check_model(body)
        _unsupported(body)
        stream, include_usage = self._stream_flags(body)
        fmt = self.session.tokenizer.chat
        if fmt is None:
            raise ApiError(400, f"'{self.model_id}' has no chat format; use /v1/completions", "model")
        messages = _messages(body.get("messages"))
        ids = _user_error(lambda: fmt.render(messages, add_generation_prompt=True), "messages")
        job = self._job(body, ids, "messages")

        def choice(text: str, finish: str | None, streaming: bool) -> dict:
            if streaming:
                delta = {"content": text} if text else {}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                    "finish_reason": finish, "logprobs": None}

        return await self._answer(request, job, stream, include_usage, "chat.completion", choice)

    async def completions(self, request: Request):
        body = await _json_body(request)
        self._check_model(body)
        _unsupported(body)
        stream, include_usage = self._stream_flags(body)
        if body.get("echo") or body.get("suffix"):
            raise ApiError(400, "'echo' and 'suffix' are not supported", "echo" if body.get("echo") else "suffix")
        ids = self._prompt_ids(body.get("prompt"))
        job = self._job(body, ids, "prompt")

        def choice(text: str, finish: str | None, streaming: bool) -> dict:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        return await self._answer(request, job, stream, include_usage, "text_completion", choice)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return _user_error(lambda: self.session.encode(prompt, chat=False), "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return _user_error(lambda: self.session.tokenizer.check_ids(list(prompt)), "prompt")
        raise ApiError(400, "'prompt' must be a non-empty string (or one string in a list, or a list of token ids)",
                       "prompt")


def _messages(messages: Any) -> list[dict]:
    """OpenAI messages as the chat format takes them: role and plain-text content."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        if m["role"] not in MESSAGE_ROLES:
            raise ApiError(400, f"messages[{i}]: role {m['role']!r} is not supported; the roles are "
                           f"{', '.join(MESSAGE_ROLES)} (system first, if at all)", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):      # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be text", f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    if not any(m["content"].strip() for m in out if m["role"] == "user"):
        raise ApiError(400, "'messages' needs a user message with some text", "messages")
    return out


def _user_error(fn: Callable[[], list[int]], param: str) -> list[int]:
    try:
        return fn()
    except UserError as e:
        raise ApiError(400, str(e), param) from None


def _internal(e: BaseException) -> ApiError:
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", None, None, "server_error")


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", None, "shutting_down", "server_error")


def _as_api_error(e: BaseException) -> ApiError:
    """What a failed job reports: the runtime's refusals are the request's fault, the rest ours."""
    if isinstance(e, ApiError):
        return e
    return ApiError(400, str(e)) if isinstance(e, UserError) else _internal(e)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(worker: Worker, model_id: str) -> Starlette:
    api = Api(worker, model_id)

    async def api_error(request, e: ApiError):
        return _error_response(e)

    async def http_error(request, e: HTTPException):
        code = "not_found" if e.status_code == 404 else None
        return _error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", None, code))

    async def server_error(request, e: Exception):
        return _error_response(_internal(e))

    return Starlette(
        routes=[Route("/v1/models", api.models, methods=["GET"]),
                Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
                Route("/v1/completions", api.completions, methods=["POST"])],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error})


class _Server(uvicorn.Server):
    """uvicorn, plus: Ctrl-C cancels the running and queued answers before the connections close."""

    def __init__(self, config: uvicorn.Config, worker: Worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame) -> None:
        self.worker.cancel_all("shutdown")
        super().handle_exit(sig, frame)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama32_1b_inference.py --serve",
                                description="OpenAI-compatible HTTP server (/v1/models, /v1/chat/completions, "
                                            "/v1/completions) for one model on one device.")
    p.add_argument("--model", "-m", default="instruct", help="as for make run (default: instruct)")
    p.add_argument("--device", choices=DEVICE_KINDS, default="auto")
    p.add_argument("--max-context", type=positive_int, help="KV cache length in positions (default 4096)")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--queue-size", type=positive_int, default=DEFAULT_QUEUE_SIZE,
                   help=f"requests that may wait for the model; more get 503 (default {DEFAULT_QUEUE_SIZE})")
    p.add_argument("--run-only", action="store_true", help="never compile; fail if the kernel cache lacks a group")
    p.add_argument("--verbose", "-v", action="store_true", help="tracebacks on errors")
    return p


def _listen(host: str, port: int) -> socket.socket:
    """Bind before the model loads, so a taken port fails in a second, not after the load."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def serve(build_session: Callable, argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    def log(line: str) -> None:
        print(line, flush=True)

    sock = None
    try:
        sock = _listen(args.host, args.port)
        session = build_session(args.model, args.device, args.max_context, allow_compile=not args.run_only, log=log)
    except (UserError, KeyboardInterrupt) as e:
        if sock is not None:
            sock.close()
        return 130 if isinstance(e, KeyboardInterrupt) else user_error(e, args.verbose)
    worker = Worker(session, args.queue_size, log=log)
    host, port = sock.getsockname()[:2]
    model_id = session.resolved.name
    log(f"[serve] model '{model_id}' on {type(session.device).__name__}, context {worker.max_context}, "
        f"queue {args.queue_size}; ready in {session.build_s:.1f} s")
    log(f"[serve] OpenAI-compatible API at http://{host}:{port}/v1 (Ctrl-C stops)")
    config = uvicorn.Config(create_app(worker, model_id), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    try:
        _Server(config, worker).run(sockets=[sock])
    except KeyboardInterrupt:       # uvicorn re-raises the Ctrl-C it handled, once it has stopped
        pass
    finally:
        worker.stop(timeout=SHUTDOWN_GRACE_S)
        sock.close()
    log("[serve] stopped")
    return 0
