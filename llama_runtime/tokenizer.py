"""Text <-> token ids for the runtime: prompt encoding, chat formats, streaming decode.

The tokenizer itself is the checkpoint's own HF fast tokenizer (never remote code). Around it
this module adds what the runtime needs to be safe and incremental:

* User text is always tokenized with special-token strings treated as plain text, so typing
  "<|eot_id|>" cannot end a turn or forge a role; only the chat format inserts control tokens,
  and it inserts them by id.
* Chat formats are built here from token ids and plain-text segments rather than by running a
  Jinja template: the Llama 3.2 tokenizer shipped for tests has no template at all, and an
  explicit format also yields the incremental `continuation` multi-turn chat needs to prefill
  only new tokens.
* Every id handed to the model is checked against the model's vocabulary, because tokenizers
  can be larger than the embedding (the Llama 3.2 vision tokenizer adds `<|image|>`).
"""
from __future__ import annotations

import datetime
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path

from llama_base.config import LlamaConfig
from llama_base.errors import CheckpointError, PromptError

# Tokens that end generation in the model families we run; whichever exist are used.
END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>")
LLAMA3_KNOWLEDGE_CUTOFF = "December 2023"
LLAMA3_DATE_FORMAT = "%d %b %Y"  # the "Today Date" line as Llama 3.x was trained with it: 26 Jul 2024
CHAT_ROLES = ("user", "assistant")

Part = int | str  # a control token id, or plain text tokenized without special-token parsing


def load_tokenizer(folder: str | Path):
    """The checkpoint's HF fast tokenizer, loaded from local files only and never with remote code."""
    from transformers import AutoTokenizer

    try:
        # Cleanup of "spaces before punctuation" is a WordPiece-era heuristic that corrupts BPE text.
        return AutoTokenizer.from_pretrained(
            str(folder), trust_remote_code=False, local_files_only=True, clean_up_tokenization_spaces=False
        )
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None


class ChatFormat(ABC):
    """A conversation layout: a prefix (system block), then turns of header + content + end.

    The generation prompt is the assistant header, and an assistant turn is that header, the
    answer and the end-of-turn parts. So a conversation kept as tokens (prompt, generated
    answer, `continuation(next question)`, ...) is `render` of the whole conversation, token
    for token whenever the answer's tokens are the tokenization of its text, and a chat
    session only ever prefills the new tokens.
    """

    CONTROL: tuple[str, ...] = ()  # control tokens the format needs; a vocabulary with all of them uses it

    def __init__(self, tokenizer: "Tokenizer", today: datetime.date | None = None):
        self.tokenizer = tokenizer
        self.today = today  # for formats that print a date; None means the day of rendering

    @abstractmethod
    def _prefix(self, system: str | None) -> list[Part]:
        """What precedes the first turn; `system` is None when the conversation has none."""

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

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a whole conversation: `[{"role": ..., "content": ...}, ...]`.

        An optional first message with role "system" replaces the default system text; other
        messages alternate freely between "user" and "assistant".
        """
        messages = list(messages)
        for m in messages:
            if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
                raise PromptError(f"a chat message must be a mapping with a text 'content', got {m!r}")
        system = None
        if messages and messages[0].get("role") == "system":
            system, messages = messages[0]["content"], messages[1:]
        parts = self._prefix(system)
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

    def __init__(self, tokenizer: "Tokenizer", today: datetime.date | None = None):
        super().__init__(tokenizer, today)
        self.bos, self.start_header, self.end_header, self.eot = map(tokenizer.special_id, self.CONTROL)

    def _prefix(self, system):
        date = (self.today or datetime.date.today()).strftime(LLAMA3_DATE_FORMAT)
        text = f"Cutting Knowledge Date: {LLAMA3_KNOWLEDGE_CUTOFF}\nToday Date: {date}\n\n{system or ''}"
        return [self.bos] + self._turn("system", text)

    def _header(self, role):
        return [self.start_header, role, self.end_header, "\n\n"]

    def _end_of_turn(self):
        return [self.eot]


class ChatMLFormat(ChatFormat):
    """`<|im_start|>role\\ncontent<|im_end|>\\n` turns (SmolLM2 and other ChatML models).

    The default system text is read from the tokenizer's own chat template, where ChatML
    models keep it, so it is never restated here.
    """

    CONTROL = ("<|im_start|>", "<|im_end|>")

    def __init__(self, tokenizer: "Tokenizer", today: datetime.date | None = None):
        super().__init__(tokenizer, today)
        self.im_start, self.im_end = map(tokenizer.special_id, self.CONTROL)
        self.default_system = chatml_default_system(tokenizer.hf.chat_template)

    def _prefix(self, system):
        system = self.default_system if system is None else system
        return [] if system is None else self._turn("system", system)

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


class Tokenizer:
    """The runtime's view of a checkpoint's tokenizer, bound to the model's config.

    The config decides which ids may reach the model and which end generation; `today` pins
    the date a chat format prints, for reproducible prompts.
    """

    def __init__(self, folder: str | Path, config: LlamaConfig | None = None, today: datetime.date | None = None):
        self.folder = Path(folder)
        self.config = config or LlamaConfig.from_json(self.folder)
        self.hf = load_tokenizer(self.folder)
        self._special = dict(self.hf.get_added_vocab())
        self.vocab_size = self.config.vocab_size
        ends = set(self.config.eos_token_ids) | {self._special.get(t) for t in END_TOKENS}
        ends.add(self.hf.eos_token_id)
        self.end_token_ids = frozenset(i for i in ends if i is not None and 0 <= i < self.vocab_size)
        # The format follows from the control tokens the vocabulary has (None: raw prompts only).
        self.chat: ChatFormat | None = next(
            (fmt(self, today) for fmt in CHAT_FORMATS if all(t in self._special for t in fmt.CONTROL)), None
        )

    def special_id(self, token: str) -> int:
        """Id of an added (control) token of this vocabulary, e.g. "<|eot_id|>"."""
        if token not in self._special:
            raise CheckpointError(f"{self.folder}: the tokenizer has no {token} token")
        return self._special[token]

    def encode_text(self, text: str) -> list[int]:
        """Plain text to ids: no BOS, and special-token strings stay ordinary text."""
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def check_ids(self, ids: list[int]) -> list[int]:
        """`ids` unchanged, or a PromptError if one would index past the model's embedding."""
        for i in ids:
            if not 0 <= i < self.vocab_size:
                name = f" ({self.hf.convert_ids_to_tokens(i)!r})" if 0 <= i < len(self.hf) else ""
                raise PromptError(f"token id {i}{name} is outside the model's vocabulary of {self.vocab_size} tokens")
        return ids

    def encode_prompt(self, text: str, chat: bool, system: str | None = None) -> list[int]:
        """Prompt ids: the chat format around one user message, or the raw text with the
        tokenizer's own BOS rule."""
        if not isinstance(text, str):
            raise PromptError(f"the prompt must be text, got {type(text).__name__}")
        if chat:
            if self.chat is None:
                raise PromptError(f"{self.folder}: this tokenizer has no chat format; use a raw (non-chat) prompt")
            system_msg = [] if system is None else [{"role": "system", "content": system}]
            return self.chat.render(system_msg + [{"role": "user", "content": text}])
        if system is not None:
            raise PromptError("a system prompt needs chat mode")
        ids = self.hf(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]
        if not ids:
            raise PromptError("the prompt is empty")
        return self.check_ids(list(ids))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenization for streaming output.

    A token can end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK),
    and some decoders change a token's text depending on what precedes it. So each step
    decodes a short window that starts at the previously emitted token, emits only the text
    beyond that token's, and holds everything back while the window ends in an incomplete
    character. The emitted pieces, plus `flush()`, concatenate to `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: the last emitted chunk, kept as decoding context
        self._read = 0    # ids before this index have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, force: bool) -> str:
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if not force and (text.endswith("\ufffd") or len(text) <= len(done)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def push(self, token_id: int) -> str:
        """Feed one generated id; returns the text it completes (often "", never half a character)."""
        self._ids.append(int(token_id))
        return self._emit(force=False)

    def flush(self) -> str:
        """Whatever is still held back (only non-empty if generation stopped mid-character)."""
        return self._emit(force=True)
