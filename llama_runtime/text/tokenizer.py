"""Text <-> token ids for the runtime: prompt encoding, the chat format a vocabulary supports, streaming decode.

The tokenizer itself is the checkpoint's own `tokenizer.json`, run by the `tokenizers` package
directly (never remote code, and never transformers: importing it costs seconds of start-up,
more than everything else `make run` does before the first prompt on a warm kernel cache).
What transformers' fast tokenizer adds on top of that file at load time (named special tokens
missing from the file, a post-processor rebuilt from `add_bos_token`/`add_eos_token`) is
reproduced here, so ids and text are the same as `AutoTokenizer` gives; the tests compare them.
Around it this module adds what the runtime needs to be safe and incremental:

* User text is always tokenized with special-token strings treated as plain text, so typing
  "<|eot_id|>" cannot end a turn or forge a role; only the chat format inserts control tokens,
  and it inserts them by id.
* Chat formats (`chat_format`) are built from token ids and plain-text segments rather than by
  running a Jinja template: the Llama 3.2 tokenizer shipped for tests has no template at all,
  and an explicit format also yields the incremental `continuation` multi-turn chat needs to
  prefill only new tokens.
* Every id handed to the model is checked against the model's vocabulary, because tokenizers
  can be larger than the embedding (the Llama 3.2 vision tokenizer adds `<|image|>`).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llama_base.config import LlamaConfig
from llama_base.errors import CheckpointError, PromptError
from llama_runtime.text.chat_format import CHAT_FORMATS, ChatFormat

if TYPE_CHECKING:
    import tokenizers

# Tokens that end generation in the model families we run; whichever exist are used.
END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>")


TOKENIZER_JSON = "tokenizer.json"
# transformers' named special tokens; a folder may name one its tokenizer.json does not define.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: cannot load the tokenizer (not a JSON object)")
    return data


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer folder as loaded: the backend with transformers' load-time fix-ups applied,
    the named special tokens (tokenizer_config.json over special_tokens_map.json) and the chat
    template, whichever of its three homes it lives in."""

    backend: "tokenizers.Tokenizer"
    special_tokens: dict[str, str]
    chat_template: str | dict[str, str] | None


def _chat_template(folder: Path, settings: Mapping) -> str | dict[str, str] | None:
    # transformers' precedence: chat_template.jinja, then chat_template.json, then the config key.
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template", settings.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
    return template if isinstance(template, (str, dict)) else None


def load_tokenizer(folder: str | Path) -> TokenizerFiles:
    """A checkpoint's tokenizer from local files only, as transformers' fast tokenizer sets it up."""
    from tokenizers import AddedToken, processors
    from tokenizers import Tokenizer as Backend

    folder = Path(folder)
    if not (folder / TOKENIZER_JSON).is_file():
        raise CheckpointError(f"{folder}: cannot load the tokenizer (no {TOKENIZER_JSON}; a fast tokenizer is needed)")
    try:
        backend = Backend.from_file(str(folder / TOKENIZER_JSON))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{folder}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
    settings = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_content(settings.get(k, special_map.get(k))))}
    # Padding or truncation saved in tokenizer.json would change single-prompt ids; transformers
    # turns both off unless a call asks for them, and the runtime never does.
    backend.no_padding()
    backend.no_truncation()

    # Tokens the config declares but tokenizer.json lacks are appended, as transformers does.
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    decoder = settings.get("added_tokens_decoder")
    entries = sorted(decoder.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else -1) \
        if isinstance(decoder, Mapping) else []
    declared = [
        AddedToken(c, special=bool(spec.get("special", True)), normalized=bool(spec.get("normalized", False)),
                   lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                   single_word=bool(spec.get("single_word", False)))
        for _, spec in entries
        if isinstance(spec, Mapping) and isinstance(c := spec.get("content"), str) and c and c not in added
    ]
    extra = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
    named = [t for t in (*special.values(), *map(_token_content, extra if isinstance(extra, list) else []))
             if t and t not in added]
    declared += [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named)
                 if t not in {d.content for d in declared}]
    if declared:
        backend.add_tokens(declared)

    # transformers replaces the file's post-processor (which decides BOS/EOS on raw prompts)
    # when the config states add_bos_token/add_eos_token, or when the file has none.
    if "add_bos_token" in settings or "add_eos_token" in settings or backend.post_processor is None:
        bos, eos = special.get("bos_token"), special.get("eos_token")
        add_bos = bool(settings.get("add_bos_token", False)) and bos is not None
        add_eos = bool(settings.get("add_eos_token", False)) and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        pieces = [(bos, backend.token_to_id(bos))] if add_bos else []
        pieces += [(eos, backend.token_to_id(eos))] if add_eos else []
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=pieces)
    # User text never yields control tokens: special-token strings in it are tokenized as text.
    backend.encode_special_tokens = True
    return TokenizerFiles(backend, special, _chat_template(folder, settings))


class Tokenizer:
    """The runtime's view of a checkpoint's tokenizer, bound to the model's config.

    The config decides which ids may reach the model and which end generation; `today` pins
    the date a chat format prints, for reproducible prompts.
    """

    def __init__(self, folder: str | Path, config: LlamaConfig | None = None, today: datetime.date | None = None):
        self.folder = Path(folder)
        self.config = config or LlamaConfig.from_json(self.folder)
        files = load_tokenizer(self.folder)
        self._backend, self.chat_template = files.backend, files.chat_template
        self._special = {t.content: i for i, t in sorted(self._backend.get_added_tokens_decoder().items())}
        self.bos_token_id = self.token_id(files.special_tokens.get("bos_token"))
        self.eos_token_id = self.token_id(files.special_tokens.get("eos_token"))
        self.vocab_size = self.config.vocab_size
        ends = set(self.config.eos_token_ids) | {self._special.get(t) for t in END_TOKENS} | {self.eos_token_id}
        self.end_token_ids = frozenset(i for i in ends if i is not None and 0 <= i < self.vocab_size)
        # The format follows from the control tokens the vocabulary has (None: raw prompts only).
        self.chat: ChatFormat | None = next(
            (fmt(self, today) for fmt in CHAT_FORMATS if all(t in self._special for t in fmt.CONTROL)), None
        )

    def __len__(self) -> int:
        """The tokenizer's whole vocabulary, added tokens included; may exceed the model's."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def added_vocab(self) -> dict[str, int]:
        """The added tokens (control tokens and the like), text -> id."""
        return dict(self._special)

    def token_id(self, token: str | None) -> int | None:
        """Id of a token of the whole vocabulary, or None if there is no such token."""
        return None if token is None else self._backend.token_to_id(token)

    def serialized(self) -> str:
        """The tokenizer as `tokenizers` JSON, load-time fix-ups included, for libraries that
        build their own view of the vocabulary (constrained decoding)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        """A token's vocabulary entry (byte-level, not decoded text), for messages about ids."""
        return self._backend.id_to_token(token_id)

    def special_id(self, token: str) -> int:
        """Id of an added (control) token of this vocabulary, e.g. "<|eot_id|>"."""
        if token not in self._special:
            raise CheckpointError(f"{self.folder}: the tokenizer has no {token} token")
        return self._special[token]

    def encode_text(self, text: str) -> list[int]:
        """Plain text to ids: no BOS, and special-token strings stay ordinary text."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def check_ids(self, ids: list[int]) -> list[int]:
        """`ids` unchanged, or a PromptError if one would index past the model's embedding."""
        for i in ids:
            if not 0 <= i < self.vocab_size:
                name = f" ({self.id_to_token(i)!r})" if 0 <= i < len(self) else ""
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
        ids = self._backend.encode(text, add_special_tokens=True).ids
        if not ids:
            raise PromptError("the prompt is empty")
        return self.check_ids(list(ids))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # No "clean-up of spaces before punctuation": a WordPiece-era heuristic that corrupts BPE text.
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

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

    def flush(self, keep_partial: bool = True) -> str:
        """Whatever is still held back (only non-empty if generation stopped mid-character).

        With `keep_partial=False` the incomplete character's bytes are dropped instead of
        showing as U+FFFD: an answer cut by a token budget ends before that character, as its
        stream did.
        """
        text = self._emit(force=True)
        return text if keep_partial else text.rstrip("\ufffd")
