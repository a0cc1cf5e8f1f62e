"""The Ollama API's core (/api/chat, /api/generate, /api/tags, /api/show, /api/ps,
/api/version) in front of the same worker as the OpenAI routes.

Editors and front ends that speak only Ollama then work with this server unchanged. Nothing
here generates or keeps state: a request becomes the same `Job` the OpenAI routes submit
(`Api._job`, `Api._submit`, `Api._finished`), read back in Ollama's shapes: newline-delimited
JSON objects while streaming (Ollama's default), the last one `done` with Ollama's counters,
durations in nanoseconds. Errors are Ollama's body, {"error": "one line"}, made here because
the app's handlers write OpenAI's.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import time
import uuid
from dataclasses import replace
from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llama_base.config import layer_shapes
from llama_runtime.generation.logprobs import MAX_TOP_CHAT, TokenText
from llama_runtime.serve.events import Done, Failed, TextPiece, ToolCall
from llama_runtime.serve.ollama_request import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    format_schema,
    refuse_unsupported,
    sampling,
    stream_flag,
    text_field,
)
from llama_runtime.serve.openai_request import (
    ApiError,
    as_api_error,
    as_request_error,
    bool_param,
    chat_messages,
    int_param,
    json_body,
    shutting_down,
)
from llama_runtime.serve.tool_calls import tool_request
from llama_runtime.serve.worker import Job

# The Ollama release whose request and answer fields these routes follow: clients read it to
# decide which features (tools, schemas in `format`) they may use.
OLLAMA_VERSION = "0.9.0"
NEVER = "9999-12-31T23:59:59Z"     # /api/ps `expires_at`: the model stays for the server's life
NS = 1_000_000_000
PREFIX = "/api/"                   # every Ollama route's; loading.py answers them in Ollama's shape too


def routes(api) -> list[Route]:
    """The routes, bound to the app's `Api`; any other /api path gets Ollama's error body too."""
    o = Ollama(api)
    table = {"/api/chat": (o.chat, "POST"), "/api/generate": (o.generate, "POST"), "/api/show": (o.show, "POST"),
             "/api/tags": (o.tags, "GET"), "/api/ps": (o.ps, "GET"), "/api/version": (o.version, "GET")}
    o.allowed = {path: [m, "HEAD"] if m == "GET" else [m] for path, (_, m) in table.items()}
    return [*(Route(path, o.guard(handler), methods=[m]) for path, (handler, m) in table.items()),
            Route(PREFIX + "{rest:path}", o.guard(o.unknown), methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]


def _stamp(when: datetime) -> str:
    """A UTC time as Ollama writes its timestamps."""
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return _stamp(datetime.now(timezone.utc))


def _call(call: dict) -> dict:
    """An OpenAI tool call (tool_calls.py) as Ollama writes one: arguments as an object."""
    f = call["function"]
    return {"function": {"name": f["name"], "arguments": json.loads(f["arguments"])}}


class Ollama:
    """The Ollama routes over the app's `Api`, whose worker, session and checks they share."""

    def __init__(self, api):
        self.api = api
        self.session = api.session
        self.allowed: dict[str, list[str]] = {}

    def guard(self, handler):
        """`handler` with every refusal, and any bug, answered in Ollama's shape (the app's
        handlers would answer OpenAI's) and logged as the app logs its refusals."""
        async def run(request: Request):
            try:
                return await handler(request)
            except ApiError as e:
                return self._refused(request, e.status, e.message, e.headers)
            except Exception as e:  # noqa: BLE001 -- a bug: still Ollama's body, and the server goes on
                return self._refused(request, 500, f"internal error: {type(e).__name__}: {e}")
        return run

    def _refused(self, request: Request, status: int, message: str, headers=None) -> JSONResponse:
        message = " ".join(str(message).split())
        self.api.log(f"[serve] {request.method} {request.url.path} refused: {status}: {message}")
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def _model(self, body: dict, names=("model",)) -> str:
        """The model the request names, as it named it (answers echo it). Ollama's clients
        add the tag ":latest" to a name without one, so that names the served model too."""
        name = next((body[n] for n in names if body.get(n) is not None), None)
        if name is None or name == "":
            raise ApiError(400, "'model' is required", "model")
        if not isinstance(name, str):
            raise ApiError(400, f"'model' must be a string, got {json.dumps(name)}", "model")
        if name not in (self.api.model_id, f"{self.api.model_id}:latest"):
            raise ApiError(404, f"model '{name}' not found; this server runs '{self.api.model_id}'", "model")
        return name

    # ---- answers ----
    async def chat(self, request: Request):
        started = time.perf_counter()
        body = await json_body(request)
        model = self._model(body)
        stream = stream_flag(body)
        refuse_unsupported(body)
        if body.get("messages") in (None, []):     # Ollama's way to load a model: it always is
            return self._loaded(request, model, {"message": {"role": "assistant", "content": ""}})
        fmt = self.session.tokenizer.chat
        if fmt is None:
            raise ApiError(400, f"'{self.api.model_id}' has no chat format; use /api/generate with raw: true", "model")
        messages = chat_messages(body["messages"])
        tools = tool_request({"tools": body.get("tools")})
        ids = as_request_error(lambda: fmt.render(messages, add_generation_prompt=True,
                                                  tools=tools.tools if tools else None), "messages")
        job = await self._job(body, ids, "messages")
        job.tools = tools

        def part(text: str, call: dict | None) -> dict:
            message = {"role": "assistant", "content": text}
            if call:
                message["tool_calls"] = [_call(call)]
            return {"message": message}

        return await self._answer(request, job, stream, model, started, part)

    async def generate(self, request: Request):
        started = time.perf_counter()
        body = await json_body(request)
        model = self._model(body)
        stream = stream_flag(body)
        refuse_unsupported(body)
        prompt, system, raw = text_field(body, "prompt"), text_field(body, "system"), bool_param(body, "raw")
        if prompt is None:                         # as in /api/chat: a request to load the model
            return self._loaded(request, model, {"response": ""})
        if not prompt.strip():
            raise ApiError(400, "'prompt' is empty", "prompt")
        if raw and system is not None:
            raise ApiError(400, "'system' goes into the chat template, which raw: true leaves out", "system")
        ids = as_request_error(lambda: self.session.encode(prompt, chat=False if raw else None, system=system),
                               "prompt")
        job = await self._job(body, ids, "prompt")
        return await self._answer(request, job, stream, model, started, lambda text, call: {"response": text})

    async def _job(self, body: dict, ids: list[int], param: str) -> Job:
        """The OpenAI routes' job for these ids (the same context check and sampling), with
        what `options`, `format` and `logprobs` add."""
        s = sampling(body.get("options"), self.api.worker.max_context)
        job = self.api._job(s.openai, ids, param)
        job.sampling = replace(job.sampling, top_k=s.top_k, repetition_penalty=s.repeat_penalty)
        job.stops = s.stops
        if bool_param(body, "logprobs"):
            job.logprobs = int_param(body, "top_logprobs", 0, MAX_TOP_CHAT) or 0
        schema = format_schema(body.get("format"))
        if schema is not None:
            job.constraint = await self.api._grammar(schema, "format")
        return job

    async def _answer(self, request: Request, job: Job, stream: bool, model: str, started: float, part):
        """Run `job`; `part(text, call)` is the route's own field of an answer ("message" or
        "response")."""
        texts = TokenText(self.session.tokenizer) if job.logprobs is not None else None
        job.id = f"ollama-{uuid.uuid4().hex[:24]}"   # the worker's log line names it
        self.api._submit(job)

        def answer(text: str, call: dict | None, logprobs, done: Done | None = None) -> dict:
            out = {"model": model, "created_at": _now(), **part(text, call), "done": done is not None}
            if texts is not None:
                out["logprobs"] = texts.chat_content(logprobs)
            return out if done is None else {**out, **self._counters(done, started)}

        if stream:
            return StreamingResponse(self._lines(job, answer), media_type="application/x-ndjson",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finished = await self.api._finished(request, job)
        if finished is None:                        # the client left; nobody reads this
            return Response(status_code=499)
        done, before = finished
        call = next((e.call for e in before if isinstance(e, ToolCall)), None)
        return JSONResponse(answer("" if call else done.text, call, done.logprobs, done))

    async def _lines(self, job: Job, answer):
        def line(obj: dict) -> str:
            return json.dumps(obj, ensure_ascii=False) + "\n"

        try:
            while True:
                match await job.events.get():
                    case TextPiece(text, logprobs) if text or (logprobs and job.logprobs is not None):
                        yield line(answer(text, None, logprobs))
                    case ToolCall(call, logprobs):
                        yield line(answer("", call, logprobs))
                    case Failed(error):
                        yield line({"error": " ".join(as_api_error(error).message.split())})
                        return
                    case Done(cancelled_by=by) if by is not None:
                        yield line({"error": shutting_down().message})
                        return
                    case Done() as done:
                        yield line(answer("", None, [], done))
                        return
        finally:
            job.cancel("client")        # a no-op once the job is done; else the client has gone

    @staticmethod
    def _counters(done: Done, started: float) -> dict:
        """Ollama's counters. The prompt count is the whole prompt, the part reused from the
        cache included; its duration is the time to the first token. The model is always
        loaded, so loading takes no time; time spent queued counts in the total only."""
        eval_s = done.completion_tokens / done.tokens_per_s if done.tokens_per_s > 0 else 0.0
        return {"done_reason": "stop" if done.finish_reason == "tool_calls" else done.finish_reason,
                "total_duration": int((time.perf_counter() - started) * NS), "load_duration": 0,
                "prompt_eval_count": done.prompt_tokens, "prompt_eval_duration": int(done.ttft_s * NS),
                "eval_count": done.completion_tokens, "eval_duration": int(eval_s * NS)}

    def _loaded(self, request: Request, model: str, part: dict) -> JSONResponse:
        self.api._served(request)
        return JSONResponse({"model": model, "created_at": _now(), **part, "done": True, "done_reason": "load"})

    # ---- the model ----
    @functools.cached_property
    def _card(self) -> dict:
        """/api/tags' entry. The digest fingerprints the checkpoint's config and its weight
        files' names and sizes: hashing gigabytes of weights would hold up the first request."""
        folder, cfg = self.session.resolved.folder, self.session.config
        files = sorted(folder.glob("*.safetensors"))
        digest = hashlib.sha256((folder / "config.json").read_bytes())
        for f in files:
            digest.update(f"{f.name}:{f.stat().st_size}\n".encode())
        modified = datetime.fromtimestamp((folder / "config.json").stat().st_mtime, timezone.utc)
        n = _parameter_count(cfg)
        return {"name": self.api.model_id, "model": self.api.model_id,
                "modified_at": _stamp(modified),
                "size": sum(f.stat().st_size for f in files), "digest": digest.hexdigest(),
                "details": {"parent_model": "", "format": "gguf" if self.session.resolved.gguf else "safetensors",
                            "family": "llama", "families": ["llama"],
                            "parameter_size": f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M",
                            "quantization_level": self.session.model.quant.upper()}}

    async def tags(self, request: Request):
        self.api._served(request)
        return JSONResponse({"models": [self._card]})

    async def ps(self, request: Request):
        self.api._served(request)
        card = {k: v for k, v in self._card.items() if k != "modified_at"}
        return JSONResponse({"models": [{**card, "expires_at": NEVER, "size_vram": 0,
                                         "context_length": self.api.worker.max_context}]})

    async def version(self, request: Request):
        self.api._served(request)
        return JSONResponse({"version": OLLAMA_VERSION})

    async def show(self, request: Request):
        """The model's details and architecture, under the keys Ollama uses for a Llama.
        `llama.context_length` is the context this server runs (`--max-context`), the one
        clients must fit in, not the checkpoint's trained length. There is no template: the
        chat format is the tokenizer's own (chat_format.py), not an Ollama template."""
        self._model(await json_body(request), ("model", "name"))
        cfg, card = self.session.config, self._card
        defaults = {"temperature": DEFAULT_TEMPERATURE, "top_k": DEFAULT_TOP_K, "top_p": DEFAULT_TOP_P}
        info = {"general.architecture": "llama", "general.parameter_count": _parameter_count(cfg),
                "llama.context_length": self.api.worker.max_context, "llama.embedding_length": cfg.hidden_size,
                "llama.block_count": cfg.num_hidden_layers, "llama.feed_forward_length": cfg.intermediate_size,
                "llama.attention.head_count": cfg.num_attention_heads,
                "llama.attention.head_count_kv": cfg.num_key_value_heads,
                "llama.attention.key_length": cfg.head_dim, "llama.attention.value_length": cfg.head_dim,
                "llama.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps, "llama.rope.freq_base": cfg.rope_theta,
                "llama.vocab_size": cfg.vocab_size}
        self.api._served(request)
        return JSONResponse({
            "modelfile": f"FROM {self.session.resolved.folder}\n"
                         + "".join(f"PARAMETER {k} {v}\n" for k, v in defaults.items()),
            "parameters": "\n".join(f"{k} {v}" for k, v in defaults.items()),
            "details": card["details"], "model_info": info,
            "capabilities": ["completion", "tools"] if self.session.tokenizer.chat else ["completion"],
            "modified_at": card["modified_at"]})

    async def unknown(self, request: Request):
        path = request.url.path
        if path in self.allowed:
            raise ApiError(405, f"{request.method} {path}: method not allowed",
                           headers={"Allow": ", ".join(self.allowed[path])})
        raise ApiError(404, f"{request.method} {path}: not found; this server has {', '.join(self.allowed)} "
                       "of Ollama's API")


def _parameter_count(cfg) -> int:
    """From the config alone: the embedding, each layer's weights (`layer_shapes`, the one
    spelling of a layer), the final norm, and the output head where it is not the embedding's."""
    layer = sum(math.prod(shape) for shape in layer_shapes(cfg).values())
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.vocab_size * cfg.hidden_size + cfg.num_hidden_layers * layer + cfg.hidden_size + head
