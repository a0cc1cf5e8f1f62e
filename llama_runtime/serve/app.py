"""`make serve`: an OpenAI-compatible HTTP API (`/v1/models[/{id}]`, `/v1/chat/completions`,
`/v1/completions`, `/v1/embeddings`) in front of one session, beside the chat page (page.py),
the Ollama API (ollama.py), the local endpoints front ends poll (local_api.py: `/health`,
`/tokenize`, `/detokenize`) and `/metrics` (metrics.py).

Clients of local runtimes speak OpenAI's API, so this module only translates: it has a
request checked the way OpenAI would check it (openai_request.py: same error body, same status
codes), turns it into prompt token ids, and hands a `Job` to the `Worker` (worker.py),
which owns the model and answers with typed events (events.py).
Everything here runs on the event loop and never generates; streamed answers are
server-sent events in OpenAI's chunk format, closed by `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from llama_runtime.serve.openai_request import (
    DEFAULT_TEMPERATURE,
    MAX_TEMPERATURE,
    ApiError,
    as_api_error,
    as_request_error,
    bool_param,
    chat_messages,
    error_response,
    int_param,
    internal_error,
    json_body,
    logit_bias,
    number_param,
    refuse_unsupported,
    response_format_schema,
    shutting_down,
    stop_strings,
)
from llama_runtime.generation.constrained import GrammarError, Grammars
from llama_runtime.generation.logprobs import MAX_TOP_CHAT, MAX_TOP_COMPLETIONS, TokenText
from llama_runtime.generation.sampling import SamplingParams
from llama_runtime.serve.events import Done, Event, Failed, PromptScores, TextPiece, ToolCall
from llama_runtime.serve.worker import Job, QueueFull, Worker
from llama_runtime.generation.session import Session
from llama_runtime.serve import local_api, ollama, page
from llama_runtime.serve.loading import Gate
from llama_runtime.serve.metrics import Metrics
from llama_runtime.serve.tool_calls import ToolRequest, tool_request

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions (chat: the rest of the context)
SHUTDOWN_GRACE_S = 5       # in-flight answers are cancelled at once; this bounds their goodbye
# A route's shaping of one choice: (piece or call, finish_reason, streaming, prompt scores if echoed).
Choice = Callable[..., dict]


class Api:
    """The routes, bound to one worker and its session."""

    def __init__(self, worker: Worker, model_id: str, log: Callable[[str], None] = print):
        self.worker = worker
        self.log = log
        self.session: Session = worker.session
        self.model_id = model_id
        self.created = int(time.time())
        self.grammars = Grammars(self.session.tokenizer)

    # ---- shared by both completion routes ----
    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required and must be a string", "model")
        if model != self.model_id:
            raise ApiError(404, f"the model '{model}' does not exist; this server runs '{self.model_id}'",
                           "model", "model_not_found")

    def _job(self, body: dict, ids: list[int], prompt_param: str, default_max_tokens: int | None = None) -> Job:
        limit = self.worker.max_context
        if len(ids) >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens, and the prompt has "
                           f"{len(ids)} tokens, leaving no room for an answer", prompt_param, "context_length_exceeded")
        newer, older = int_param(body, "max_completion_tokens", 1, limit), int_param(body, "max_tokens", 1, limit)
        max_tokens = older if newer is None else newer
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        room = limit - len(ids)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        temperature = number_param(body, "temperature", DEFAULT_TEMPERATURE, lambda t: 0 <= t <= MAX_TEMPERATURE,
                              f"between 0 and {MAX_TEMPERATURE:g}")
        top_p = number_param(body, "top_p", 1.0, lambda p: 0 <= p <= 1, "in [0, 1]")
        if top_p == 0:                  # OpenAI's clients send it for "the most likely token only"
            temperature, top_p = 0.0, 1.0
        seed = int_param(body, "seed", -sys.maxsize - 1, sys.maxsize)
        bias = logit_bias(body, self.session.config.vocab_size)
        sampling = SamplingParams(temperature, 0, top_p, 1.0, seed, bias)
        return Job(ids, max_tokens, sampling, stop_strings(body), asyncio.get_running_loop())

    def _stream_flags(self, body: dict) -> tuple[bool, bool]:
        stream = bool_param(body, "stream")
        opts = body.get("stream_options")
        if opts is None:
            return stream, False
        if not isinstance(opts, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed with stream=true", "stream_options")
        return stream, bool_param(opts, "include_usage")

    def _submit(self, job: Job) -> Job:
        try:
            return self.worker.submit(job)
        except QueueFull as e:
            raise ApiError(503, str(e), None, "server_busy", "server_error",
                           {"Retry-After": str(e.retry_after_s)}) from None

    @staticmethod
    def _usage(out) -> dict:
        """OpenAI's usage, plus `timings` (this server's own figures, which clients that do not
        know them ignore): seconds queued, time to first token, decode tokens per second."""
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
                "timings": {"queued_s": round(out.queued_s, 4), "ttft_s": round(out.ttft_s, 4),
                            "tokens_per_s": round(out.tokens_per_s, 2)}}

    async def _answer(self, request: Request, job: Job, stream: bool, include_usage: bool,
                      kind: str, choice: Choice, echo: bool = False):
        """Run `job` and answer as one JSON object or as server-sent events. `choice(piece,
        finish_reason, streaming, prompt)` shapes one choice for this route; `prompt` (the
        prompt tokens' scores, None where unscored) is given where the prompt is echoed."""
        rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_id}
        job.id = rid                    # the log line names the id the client sees
        self._submit(job)
        if stream:
            return StreamingResponse(self._events(job, head, include_usage, choice, echo),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finished = await self._finished(request, job)
        if finished is None:            # the client left; nobody reads this
            return JSONResponse({}, status_code=499)
        done, before = finished
        prompt = next((e.scores for e in before if isinstance(e, PromptScores)), [None] * len(job.prompt_ids))
        call = next((e for e in before if isinstance(e, ToolCall)), None)
        answer = choice(call or TextPiece(done.text, done.logprobs), done.finish_reason, False, prompt if echo else None)
        return JSONResponse({**head, "choices": [answer], "usage": self._usage(done), "system_fingerprint": None})

    async def _finished(self, request: Request, job: Job) -> tuple[Done, list[Event]] | None:
        """The job's `Done` and the events before it, or None if the client disconnected first
        (the job is then cancelled)."""
        gone = asyncio.ensure_future(_disconnected(request))
        before: list[Event] = []
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    job.cancel("client")
                    return None
                match get.result():
                    case Failed(error):
                        raise as_api_error(error)
                    case Done(cancelled_by="shutdown"):
                        raise shutting_down()
                    case Done() as done:
                        return done, before
                    case event:
                        before.append(event)
        finally:
            gone.cancel()

    async def _events(self, job: Job, head: dict, include_usage: bool, choice: Choice, echo: bool):
        chunk_kind = "chat.completion.chunk" if head["object"] == "chat.completion" else head["object"]
        head = {**head, "object": chunk_kind, "system_fingerprint": None}
        extra = {"usage": None} if include_usage else {}

        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        nothing = TextPiece("", [])
        try:
            if chunk_kind == "chat.completion.chunk":
                yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": None}], **extra})
            if echo and not job.score_prompt:      # the echoed prompt leads; no scores to wait for
                yield sse({**head, "choices": [choice(nothing, None, True, [None] * len(job.prompt_ids))], **extra})
            while True:
                match await job.events.get():
                    case PromptScores(scores):
                        yield sse({**head, "choices": [choice(nothing, None, True, scores)], **extra})
                        continue
                    case TextPiece() | ToolCall() as piece:
                        yield sse({**head, "choices": [choice(piece, None, True)], **extra})
                        continue
                    case Failed(error):
                        yield sse(as_api_error(error).body())
                    case Done(cancelled_by=by) if by is not None:
                        yield sse(shutting_down().body())
                    case Done() as done:
                        yield sse({**head, "choices": [choice(nothing, done.finish_reason, True)], **extra})
                        if include_usage:
                            yield sse({**head, "choices": [], "usage": self._usage(done)})
                yield "data: [DONE]\n\n"
                return
        finally:
            job.cancel("client")        # a no-op once the job is done; else the client has gone

    # ---- routes ----
    def _served(self, request: Request) -> None:
        """The log line of a request that needs no model (the completions' come from the worker)."""
        self.log(f"[serve] {request.method} {request.url.path} 200")

    async def models(self, request: Request):
        self._served(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request):
        model_id = request.path_params["model_id"]
        if model_id != self.model_id:
            raise ApiError(404, f"the model '{model_id}' does not exist; this server runs '{self.model_id}'",
                           "model", "model_not_found")
        self._served(request)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "llama32-1b-npu"}

    async def chat_completions(self, request: Request):
        body = await json_body(request)
        self._check_model(body)
        refuse_unsupported(body)
        stream, include_usage = self._stream_flags(body)
        fmt = self.session.tokenizer.chat
        if fmt is None:
            raise ApiError(400, f"'{self.model_id}' has no chat format; use /v1/completions", "model")
        messages = chat_messages(body.get("messages"))
        tools = tool_request(body)
        ids = as_request_error(lambda: fmt.render(messages, add_generation_prompt=True,
                                                  tools=tools.tools if tools else None), "messages")
        job = self._job(body, ids, "messages")
        wanted = bool_param(body, "logprobs")
        top = int_param(body, "top_logprobs", 0, MAX_TOP_CHAT)
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        job.logprobs = (top or 0) if wanted else None
        job.constraint = await self._constraint(body, tools)
        job.tools = tools               # the worker tells a call from text (tool_calls.CallHold)
        texts = TokenText(self.session.tokenizer)

        def choice(piece: TextPiece | ToolCall, finish: str | None, streaming: bool, prompt=None) -> dict:
            lp = {"content": texts.chat_content(piece.logprobs), "refusal": None} if wanted else None
            call = piece.call if isinstance(piece, ToolCall) else None
            text = None if call else piece.text
            if streaming:
                lp = lp if piece.logprobs else None     # as OpenAI: none on the role and finish chunks
                delta = {"tool_calls": [{"index": 0, **call}]} if call else {"content": text} if text else {}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
            message = {"role": "assistant", "content": text, "refusal": None}
            if call:
                message["tool_calls"] = [call]
            return {"index": 0, "message": message, "finish_reason": finish, "logprobs": lp}

        return await self._answer(request, job, stream, include_usage, "chat.completion", choice)

    async def _constraint(self, body: dict, tools: ToolRequest | None):
        """The grammar an answer must follow, if any. Built off the event loop: the first one
        also indexes the vocabulary (~0.2 s)."""
        rf = body.get("response_format")
        schema = tools.schema() if tools else None
        if schema is not None:
            if rf is not None and rf != {"type": "text"}:
                raise ApiError(400, "'response_format' cannot be combined with a tool_choice that requires a call",
                               "response_format")
            return await self._grammar(schema, "tools")
        wanted = response_format_schema(rf)
        return None if wanted is None else await self._grammar(*wanted)

    async def _grammar(self, schema: dict, param: str):
        try:
            return await asyncio.to_thread(self.grammars.for_schema, schema, param)
        except GrammarError as e:
            raise ApiError(400, str(e), e.param) from None

    async def completions(self, request: Request):
        body = await json_body(request)
        self._check_model(body)
        refuse_unsupported(body)
        stream, include_usage = self._stream_flags(body)
        if body.get("suffix"):
            raise ApiError(400, "'suffix' is not supported", "suffix")
        echo = bool_param(body, "echo")
        ids = self._prompt_ids(body.get("prompt"))
        job = self._job(body, ids, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
        job.logprobs = int_param(body, "logprobs", 0, MAX_TOP_COMPLETIONS)
        job.score_prompt = echo and job.logprobs is not None
        texts = TokenText(self.session.tokenizer)
        prompt_text = self.session.tokenizer.decode(ids) if echo else ""
        offset = 0                      # text_offset runs on across a stream's chunks

        def choice(piece: TextPiece, finish: str | None, streaming: bool, prompt=None) -> dict:
            nonlocal offset
            text, tokens, scores = piece.text, [e.token for e in piece.logprobs], list(piece.logprobs)
            if prompt is not None:      # the echoed prompt leads the text, its first token unscored
                text, tokens, scores = prompt_text + text, ids + tokens, prompt + scores
            lp = None
            if job.logprobs is not None and (tokens or not streaming):
                lp = texts.completion(scores, tokens, offset)
                offset += sum(len(t) for t in lp["tokens"])
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}

        return await self._answer(request, job, stream, include_usage, "text_completion", choice, echo)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return as_request_error(lambda: self.session.encode(prompt, chat=False), "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return as_request_error(lambda: self.session.tokenizer.check_ids(list(prompt)), "prompt")
        raise ApiError(400, "'prompt' must be a non-empty string (or one string in a list, or a list of token ids)",
                       "prompt")


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(worker: Worker, model_id: str, cors_origins: Sequence[str] = (),
               log: Callable[[str], None] = print) -> Starlette:
    """The app. `cors_origins` are the web origins whose pages may call the API from a
    browser (preflight OPTIONS answered); none by default, so a page elsewhere cannot use a
    server that trusts whoever reaches it. Every refused request gets one log line, as every
    answered one does in the worker."""
    api = Api(worker, model_id, log)

    def refused(request: Request, e: ApiError):
        log(f"[serve] {request.method} {request.url.path} refused: {e.status} {e.code or e.type}: {e.message}")
        return error_response(e)

    async def api_error(request, e: ApiError):
        return refused(request, e)

    async def http_error(request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        # e.headers carries 405's Allow, which clients need to learn the right method.
        return refused(request, ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", None,
                                         code, headers=e.headers))

    async def server_error(request, e: Exception):
        return refused(request, internal_error(e))

    metrics = Metrics(worker)
    routes = [*page.routes(api),
              *ollama.routes(api),
              *local_api.routes(api),
              *metrics.routes(api),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"])]
    middleware = [Middleware(metrics.middleware(routes))]
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["*"], max_age=600))
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error})


class _Server(uvicorn.Server):
    """uvicorn, plus: Ctrl-C cancels the running and queued answers before the connections close."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.worker: Worker | None = None       # set once the model has loaded

    def handle_exit(self, sig, frame) -> None:
        if self.worker is not None:
            self.worker.cancel_all("shutdown")
        super().handle_exit(sig, frame)


class StoppedWhileLoading(Exception):
    """Ctrl-C came before the model had loaded; the load is still running in its thread."""


def run(sock: socket.socket, requested: str, device_name: str, load: Callable[[], Worker],
        cors_origins: Sequence[str], log: Callable[[str], None]) -> None:
    """Serve on a bound socket until Ctrl-C, then cancel what is in flight and stop the worker.

    The port answers at once (loading.Gate: 503 "loading") while `load()` builds the worker
    in a thread of its own (resolving `requested` may build a checkpoint); its error, if it
    fails, stops the server and is raised here."""
    gate = Gate(requested, device_name)
    config = uvicorn.Config(gate, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server = _Server(config)
    failed: list[BaseException] = []
    handover = threading.Lock()
    stopped = False

    def loader() -> None:
        try:
            worker = load()
        except BaseException as e:      # noqa: BLE001 -- raised again on the serving thread
            failed.append(e)
            server.should_exit = True
            return
        with handover:
            if stopped:                 # Ctrl-C while the last of the load ran
                worker.stop(timeout=SHUTDOWN_GRACE_S)
                return
            server.worker = worker
            gate.open(create_app(worker, worker.session.resolved.name, cors_origins, log))

    thread = threading.Thread(target=loader, name="load", daemon=True)
    thread.start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:       # uvicorn re-raises the Ctrl-C it handled, once it has stopped
        pass
    finally:
        with handover:
            stopped = True
        if server.worker is not None:
            server.worker.stop(timeout=SHUTDOWN_GRACE_S)
    if failed:
        raise failed[0]
    if server.worker is None:
        raise StoppedWhileLoading()
