"""Chat layouts built from token ids and plain-text segments, not by running a Jinja template.

The Llama 3.2 tokenizer shipped for tests has no template at all, and an explicit format also
yields the incremental `continuation` that multi-turn chat needs to prefill only new tokens.
Control tokens enter only here, by id; message text is tokenized as plain text.
"""
from __future__ import annotations

import datetime
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Protocol

from llama_base.errors import PromptError

LLAMA3_KNOWLEDGE_CUTOFF = "December 2023"
LLAMA3_DATE_FORMAT = "%d %b %Y"  # the "Today Date" line as Llama 3.x was trained with it: 26 Jul 2024
CHAT_ROLES = ("user", "assistant", "tool")   # "tool": a function's result, answering a tool call
# Where a model's own format has no place for tools: their definitions go at the end of the
# system text, and a call is one JSON object, the shape Llama 3.2 uses (tool_calls.py reads it).
GENERIC_TOOLS_INTRO = ("You can call the functions below. To call one, answer with only a JSON object "
                       '{"name": function name, "parameters": an object of argument names and values}, '
                       "and nothing else.\n\n")

Part = int | str  # a control token id, or plain text tokenized without special-token parsing


class TokenSource(Protocol):
    """What a format needs of the tokenizer (`tokenizer.Tokenizer`)."""

    chat_template: str | dict[str, str] | None

    def encode_text(self, text: str) -> list[int]: ...

    def check_ids(self, ids: list[int]) -> list[int]: ...

    def special_id(self, token: str) -> int: ...


class ChatFormat(ABC):
    """A conversation layout: a prefix (system block), then turns of header + content + end.

    The generation prompt is the assistant header, and an assistant turn is that header, the
    answer and the end-of-turn parts. So a conversation kept as tokens (prompt, generated
    answer, `continuation(next question)`, ...) is `render` of the whole conversation, token
    for token whenever the answer's tokens are the tokenization of its text, and a chat
    session only ever prefills the new tokens.
    """

    CONTROL: tuple[str, ...] = ()  # control tokens the format needs; a vocabulary with all of them uses it

    def __init__(self, tokenizer: "TokenSource", today: datetime.date | None = None):
        self.tokenizer = tokenizer
        self.today = today  # for formats that print a date; None means the day of rendering

    @abstractmethod
    def _prefix(self, system: str | None, tools: bool = False) -> list[Part]:
        """What precedes the first turn; `system` is None when the conversation has none;
        `tools` says the conversation offers tools."""

    @abstractmethod
    def _header(self, role: str) -> list[Part]:
        """What precedes a turn's content."""

    @abstractmethod
    def _end_of_turn(self) -> list[Part]:
        """What follows a turn's content."""

    def _turn(self, role: str, content: str) -> list[Part]:
        return self._header(role) + [content] + self._end_of_turn()

    def _tokens(self, parts: list[Part]) -> list[int]:
        # Adjacent text is merged before tokenizing, as it would be in the rendered string, so
        # BPE sees e.g. "\n\n" + content as one piece, the way the model was trained.
        ids: list[int] = []
        text = ""
        for part in parts:
            if isinstance(part, str):
                text += part
            else:
                ids += self.tokenizer.encode_text(text) if text else []
                ids.append(part)
                text = ""
        ids += self.tokenizer.encode_text(text) if text else []
        return self.tokenizer.check_ids(ids)

    def _with_tools(self, system: str | None, messages: list, tools: Sequence[Mapping]) -> tuple[str | None, list]:
        """Place the tool definitions (OpenAI `tools` entries): by default at the end of the
        system text, in the generic layout; formats with a layout of their own override this."""
        listing = "".join(json.dumps(t, ensure_ascii=False, indent=4) + "\n\n" for t in tools)
        head = self._default_system() if system is None else system
        return (f"{head}\n\n" if head else "") + GENERIC_TOOLS_INTRO + listing.rstrip("\n"), messages

    def _default_system(self) -> str | None:
        return None

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping] | None = None) -> list[int]:
        """Token ids of a whole conversation: `[{"role": ..., "content": ...}, ...]`.

        An optional first message with role "system" replaces the default system text; other
        messages alternate freely between "user", "assistant" and "tool". `tools` (OpenAI
        `tools` entries) are described to the model where its format puts them.
        """
        messages = list(messages)
        for m in messages:
            if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
                raise PromptError(f"a chat message must be a mapping with a text 'content', got {m!r}")
        system = None
        if messages and messages[0].get("role") == "system":
            system, messages = messages[0]["content"], messages[1:]
        if tools:
            system, messages = self._with_tools(system, messages, tools)
        parts = self._prefix(system, bool(tools))
        for m in messages:
            if m.get("role") not in CHAT_ROLES:
                raise PromptError(
                    f"chat role {m.get('role')!r} is not supported (a first system message, then user/assistant)"
                )
            parts += self._turn(m["role"], m["content"])
        if add_generation_prompt:
            parts += self._header("assistant")
        return self._tokens(parts)

    def continuation(self, new_user_message: str) -> list[int]:
        """Tokens that follow an assistant answer already in the KV cache: its end of turn, the
        next user turn, and the generation prompt."""
        if not isinstance(new_user_message, str):
            raise PromptError(f"a chat message must be text, got {type(new_user_message).__name__}")
        return self._tokens(self._end_of_turn() + self._turn("user", new_user_message) + self._header("assistant"))


class Llama3ChatFormat(ChatFormat):
    """Llama 3.x instruct layout; the system block always carries the cutoff and date lines."""

    CONTROL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    # Llama 3.2's own tool layout (its chat template's default, tools in the first user
    # message): this text, then each tool as indented JSON, then the user's question.
    TOOLS_INTRO = ("Given the following functions, please respond with a JSON for a function call with its proper "
                   "arguments that best answers the given prompt.\n\n"
                   'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                   'value}.Do not use variables.\n\n')

    def __init__(self, tokenizer: "TokenSource", today: datetime.date | None = None):
        super().__init__(tokenizer, today)
        self.bos, self.start_header, self.end_header, self.eot = map(tokenizer.special_id, self.CONTROL)

    def _prefix(self, system, tools=False):
        date = (self.today or datetime.date.today()).strftime(LLAMA3_DATE_FORMAT)
        env = "Environment: ipython\n" if tools else ""
        text = f"{env}Cutting Knowledge Date: {LLAMA3_KNOWLEDGE_CUTOFF}\nToday Date: {date}\n\n{system or ''}"
        return [self.bos] + self._turn("system", text)

    def _with_tools(self, system, messages, tools):
        if not messages or messages[0].get("role") != "user":
            raise PromptError("with tools, a Llama 3 conversation must start with a user message (the tools go in it)")
        listing = "".join(json.dumps(t, ensure_ascii=False, indent=4) + "\n\n" for t in tools)
        first = {**messages[0], "content": self.TOOLS_INTRO + listing + messages[0]["content"].strip()}
        return system, [first] + list(messages[1:])

    def _header(self, role):
        # Llama 3 reads a tool's result in the "ipython" role.
        return [self.start_header, "ipython" if role == "tool" else role, self.end_header, "\n\n"]

    def _end_of_turn(self):
        return [self.eot]


class ChatMLFormat(ChatFormat):
    """`<|im_start|>role\\ncontent<|im_end|>\\n` turns (SmolLM2 and other ChatML models).

    The default system text is read from the tokenizer's own chat template, where ChatML
    models keep it, so it is never restated here.
    """

    CONTROL = ("<|im_start|>", "<|im_end|>")

    def __init__(self, tokenizer: "TokenSource", today: datetime.date | None = None):
        super().__init__(tokenizer, today)
        self.im_start, self.im_end = map(tokenizer.special_id, self.CONTROL)
        self.default_system = chatml_default_system(tokenizer.chat_template)

    def _prefix(self, system, tools=False):
        system = self.default_system if system is None else system
        return [] if system is None else self._turn("system", system)

    def _default_system(self):
        return self.default_system

    def _header(self, role):
        return [self.im_start, role + "\n"]

    def _end_of_turn(self):
        return [self.im_end, "\n"]


CHAT_FORMATS = (Llama3ChatFormat, ChatMLFormat)


def chatml_default_system(chat_template) -> str | None:
    """The system text a ChatML template inserts when a conversation has none, if any."""
    if isinstance(chat_template, Mapping):
        chat_template = chat_template.get("default")
    if not isinstance(chat_template, str):
        return None
    m = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", chat_template, re.DOTALL)
    return m.group(1) if m else None
