"""The endpoints local front ends and editors expect beside OpenAI's chat: `GET /health`,
`POST /tokenize` and `/detokenize` (llama.cpp's request and answer fields, which those tools
already speak), and OpenAI's `POST /v1/embeddings`.

An embedding is the model's own representation of the text (`Session.embed`: the final-normed
hidden state of every position, averaged, scaled to length 1), not a model trained for
retrieval: similar texts score closer than unrelated ones, and that is all it promises. It
runs on the worker like an answer, since it needs the model and its KV cache.
"""
from __future__ import annotations

import asyncio
import base64
import struct

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from llama_runtime.generation.sampling import SamplingParams
from llama_runtime.serve.events import Embedding
from llama_runtime.serve.openai_request import ApiError, as_request_error, bool_param, json_body
from llama_runtime.serve.worker import Job

ENCODINGS = ("float", "base64")
MAX_INPUTS = 256            # inputs of one embeddings request, as a bound on one request's work


def routes(api) -> list[Route]:
    tokenizer = api.session.tokenizer

    async def health(request: Request):
        """Ready or busy (a job running or queued), the model and the device: what a front end
        polls before it offers the model. Before the model has loaded, loading.Gate answers
        this route instead (503, "loading")."""
        api._served(request)
        w = api.worker
        return JSONResponse({"status": "busy" if w.busy else "ready", "model": api.model_id,
                             "device": api.session.device.name, "queued": w.queued,
                             "context": w.max_context})

    async def tokenize(request: Request):
        body = await json_body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "'content' must be a string", "content")
        special = bool_param(body, "add_special")
        ids = tokenizer.encode_prompt(content, chat=False) if special else tokenizer.encode_text(content)
        api._served(request)
        if bool_param(body, "with_pieces"):
            return JSONResponse({"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(request: Request):
        body = await json_body(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
        ids = as_request_error(lambda: tokenizer.check_ids(ids) if ids else ids, "tokens")
        api._served(request)
        return JSONResponse({"content": tokenizer.decode(ids)})

    async def embeddings(request: Request):
        body = await json_body(request)
        api._check_model(body)
        fmt = body.get("encoding_format", "float")
        if fmt not in ENCODINGS:
            raise ApiError(400, f"'encoding_format' must be one of {', '.join(ENCODINGS)}", "encoding_format")
        hidden = api.session.config.hidden_size
        dims = body.get("dimensions")
        if dims is not None and dims != hidden:
            raise ApiError(400, f"'dimensions' must be {hidden}, this model's hidden size (or left out)",
                           "dimensions")
        inputs = _inputs(body.get("input"), tokenizer, api.worker.max_context)
        data, used = [], 0
        for i, ids in enumerate(inputs):
            job = api._submit(Job(ids, 0, SamplingParams(), (), asyncio.get_running_loop(), embed=True))
            finished = await api._finished(request, job)
            if finished is None:            # the client left
                return JSONResponse({}, status_code=499)
            vector = next(e.vector for e in finished[1] if isinstance(e, Embedding))
            used += len(ids)
            data.append({"object": "embedding", "index": i, "embedding": _encoded(vector, fmt)})
        return JSONResponse({"object": "list", "data": data, "model": api.model_id,
                             "usage": {"prompt_tokens": used, "total_tokens": used}})

    return [Route("/health", health, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"])]


def _inputs(raw, tokenizer, limit: int) -> list[list[int]]:
    """OpenAI's `input` forms (a string, strings, token ids, lists of token ids) as token ids,
    each checked: not empty, within the context."""
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(i, int) for i in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'input' must be a non-empty string, a list of them, or token ids", "input")
    if len(raw) > MAX_INPUTS:
        raise ApiError(400, f"'input' holds {len(raw)} items; at most {MAX_INPUTS} a request", "input")
    out = []
    for i, item in enumerate(raw):
        where = f"input[{i}]" if len(raw) > 1 else "input"
        if isinstance(item, str):
            if not item.strip():
                raise ApiError(400, f"'{where}' is empty", where)
            ids = tokenizer.encode_prompt(item, chat=False)
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids = as_request_error(lambda: tokenizer.check_ids(item), where)
        else:
            raise ApiError(400, f"'{where}' must be a non-empty string or a list of token ids", where)
        if len(ids) > limit:
            raise ApiError(400, f"'{where}' has {len(ids)} tokens; this model's context holds {limit}", where,
                           "context_length_exceeded")
        out.append(ids)
    return out


def _encoded(vector: list[float], fmt: str):
    """float: the numbers; base64: their little-endian float32 bytes, as OpenAI's clients decode them."""
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
