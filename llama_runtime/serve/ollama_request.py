"""Reading an Ollama API request: its fields and `options`, checked here and mapped onto the
same sampling the OpenAI routes use, so that a request means the same on either API.

Refusals are `ApiError`s, like the OpenAI routes' (the same checks, the same one-line
messages); ollama.py answers them with Ollama's body, {"error": message}.

Options fall in three groups. Those that shape the answer are applied. Those that only say
how Ollama should run a model (threads, GPU layers, batch and context sizes, memory mapping)
have no meaning here and are ignored: the context is the server's `--max-context`, and a
prompt that does not fit is refused. Sampling methods this runtime lacks are accepted only
at the value that switches them off, since ignoring them would change the answer unseen.
Any other key is a mistake in the request (a typo would otherwise be silently dropped).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llama_runtime.generation.constrained import ANY_OBJECT
from llama_runtime.serve.openai_request import ApiError, int_param, number_param

# Ollama's documented defaults for what a request leaves out: its clients count on them.
# The repeat penalty is the exception: Ollama's 1.1 applies to the last 64 tokens, this
# runtime's to the whole context (prompt included), so it stays off unless asked for.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9
APPLIED = ("temperature", "top_p", "top_k", "seed", "num_predict", "stop", "repeat_penalty")
IGNORED = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "numa", "num_thread", "use_mmap",
           "use_mlock", "vocab_only", "logits_all", "embedding_only", "f16_kv", "num_keep",
           "repeat_last_n", "penalize_newline", "mirostat_tau", "mirostat_eta")
UNSUPPORTED = {"template": "the prompt is built with the model's own chat format",
               "suffix": "this model does not fill in the middle",
               "context": "this server returns none; send the conversation to /api/chat"}
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "mirostat": 0, "min_p": 0, "tfs_z": 1, "typical_p": 1}


@dataclass(frozen=True)
class Sampling:
    """`options` as the OpenAI routes' `Api._job` reads a body (`openai`), plus what it does not
    read: top-k, the repeat penalty, and stop strings without OpenAI's limit of four (Ollama
    clients send more, e.g. for code completion)."""
    openai: dict
    top_k: int
    repeat_penalty: float
    stops: tuple[str, ...]


def sampling(options: Any, context: int) -> Sampling:
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ApiError(400, f"'options' must be an object, got {json.dumps(options)}", "options")
    unknown = sorted(set(options) - set(APPLIED) - set(IGNORED) - set(NEUTRAL))
    if unknown:
        raise ApiError(400, f"unknown option {unknown[0]!r}; the options that shape the answer are "
                       f"{', '.join(APPLIED)}", "options")
    for name, off in NEUTRAL.items():
        if number_param(options, name, off, lambda v: True, "") != off:
            raise ApiError(400, f"option '{name}' is not supported; leave it at {off}", "options")
    n = int_param(options, "num_predict", -2, 2**31 - 1)
    if n == 0:
        raise ApiError(400, "option 'num_predict' must be at least 1, or -1 for the rest of the context", "options")
    top_k = int_param(options, "top_k", 0, 2**31 - 1)
    given = {k: v for k, v in options.items() if v is not None}
    openai = {"max_tokens": min(n, context) if n is not None and n > 0 else None,
              "temperature": given.get("temperature", DEFAULT_TEMPERATURE),
              "top_p": given.get("top_p", DEFAULT_TOP_P), "seed": given.get("seed")}
    return Sampling(openai, DEFAULT_TOP_K if top_k is None else top_k,
                    number_param(options, "repeat_penalty", 1.0, lambda p: p > 0, "greater than 0"),
                    stop_strings(options.get("stop")))


def stop_strings(v: Any) -> tuple[str, ...]:
    items = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(400, "option 'stop' must be a list of strings", "options")
    return tuple(s for s in items if s)


def format_schema(fmt: Any) -> dict | None:
    """The JSON schema `format` asks the answer to follow: "json" is any object."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return ANY_OBJECT
    if isinstance(fmt, dict):
        return fmt
    raise ApiError(400, f"'format' must be \"json\" or a JSON schema object, got {json.dumps(fmt)}", "format")


def stream_flag(body: dict) -> bool:
    """Ollama streams unless told not to."""
    v = body.get("stream")
    if v is None:
        return True
    if not isinstance(v, bool):
        raise ApiError(400, f"'stream' must be true or false, got {json.dumps(v)}", "stream")
    return v


def text_field(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise ApiError(400, f"'{name}' must be a string, got {json.dumps(v)}", name)
    return v


def refuse_unsupported(body: dict) -> None:
    """Fields whose request this runtime cannot honour: refused, not dropped. `keep_alive` is
    only checked: the model stays loaded for the server's life whatever it says."""
    keep = body.get("keep_alive")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, (str, int, float))):
        raise ApiError(400, f"'keep_alive' must be a duration string or a number of seconds, got {json.dumps(keep)}",
                       "keep_alive")
    if body.get("think") not in (None, False):
        raise ApiError(400, "this model does not think; leave 'think' out or false", "think")
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    images = [body.get("images")] + [m.get("images") for m in messages if isinstance(m, dict)]
    if any(images):
        raise ApiError(400, "this model reads text only; 'images' are not supported", "images")
    for name, why in UNSUPPORTED.items():
        if body.get(name):
            raise ApiError(400, f"'{name}' is not supported: {why}", name)
