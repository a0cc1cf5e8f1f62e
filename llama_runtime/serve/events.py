"""What the worker tells the HTTP side about a job, one dataclass per kind of event.

A job's queue receives `PromptScores` first if it asked for them, then `TextPiece`s (and, for
an answer that is a tool call, one `ToolCall`; for an embedding job, one `Embedding`), and
always ends with exactly one `Done` or `Failed`. The routes match on the type; nothing is tagged by a string.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llama_runtime.generation.logprobs import TokenLogprob


@dataclass(frozen=True)
class PromptScores:
    """Each prompt token's score given the ones before it (None for the first)."""
    scores: list[TokenLogprob | None]


@dataclass(frozen=True)
class TextPiece:
    """A piece of streamed text and the scores of the tokens generated since the last piece
    (empty unless asked for; the last piece can have scores and no text, when the last tokens
    add nothing that is shown)."""
    text: str
    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class ToolCall:
    """The whole answer, read as a call of an offered function (tool_calls.py)."""
    call: dict                      # OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}
    logprobs: list[TokenLogprob]    # of the tokens that wrote it


@dataclass(frozen=True)
class Embedding:
    """An embedding job's vector (`Session.embed`), before its `Done`."""
    vector: list[float]


@dataclass(frozen=True)
class Done:
    """A finished job: its usage and why it ended (the full text, for non-streaming answers)."""
    text: str
    finish_reason: str | None      # "stop" | "length" | "tool_calls"; None when the job was cancelled
    prompt_tokens: int
    cached_tokens: int             # prompt tokens whose K/V were reused rather than prefilled
    completion_tokens: int
    cancelled_by: str | None = None  # "client" | "shutdown"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    queued_s: float = 0.0          # arrival to start
    ttft_s: float = 0.0            # start of prefill to the first token chosen
    tokens_per_s: float = 0.0      # decode speed after the first token


@dataclass(frozen=True)
class Failed:
    """A job that raised: a request the runtime refused, a bug or a device failure."""
    error: Exception


Event = PromptScores | TextPiece | ToolCall | Embedding | Done | Failed
