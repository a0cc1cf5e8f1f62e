"""Structured output: a JSON schema (a request's `response_format` or required tool call, the
command line's `--json-schema`) turned into a token mask that the sampler's logits obey.

llguidance (Microsoft's Rust constrained-decoding library, one wheel with no dependencies)
compiles a JSON schema into a matcher that, after each token, gives the set of tokens that
keep the text a valid prefix of a document the schema accepts. The mask is applied to the
logits on the host, as the last logits processor (processors.GrammarMask), so it works the
same on every device, and once the document is complete only an end token is allowed.
xgrammar was measured too: as fast per token, but it installs triton (about 1 GB) and its
default JSON layout differs; see docs/profile.md.
"""
from __future__ import annotations

import threading

import llguidance
import numpy as np
import torch

from llama_base.errors import PromptError
from llama_runtime.generation.json_schema import closed

# Compact JSON (no optional whitespace): a small model can otherwise fill its budget with
# spaces and newlines that the grammar allows between tokens.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}   # the schema of "any JSON object" (OpenAI's json_object mode)


class GrammarError(PromptError):
    """A schema that cannot become a grammar; `param` names the request field (or the command
    line flag) it came from, so the caller can point at it."""

    def __init__(self, message: str, param: str):
        super().__init__(" ".join(message.split()))     # one line: llguidance's can span several
        self.param = param


def json_grammar(schema: dict, param: str) -> str:
    """The grammar of documents `schema` accepts, its objects closed where it leaves them open
    (`json_schema.closed`); a `GrammarError` naming `param` if it has none. It is checked
    without a tokenizer, so a command line refuses a bad schema before it loads a model."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(closed(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"'{param}' is not a usable JSON schema: {e}", param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"'{param}' cannot be compiled into a grammar: {error}", param)
    return grammar


class Grammars:
    """One tokenizer's view for llguidance, built on first use (~0.2 s) and shared by the
    requests, which each get their own matcher."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                t = self._tokenizer
                self._lltok = llguidance.LLTokenizer(t.serialized(), n_vocab=t.vocab_size,
                                                     eos_token=sorted(t.end_token_ids))
            return self._lltok

    def for_schema(self, schema: dict, param: str) -> "Constraint":
        """One answer's constraint to documents `schema` accepts (`json_grammar`)."""
        return self.for_grammar(json_grammar(schema, param), param)

    def for_grammar(self, grammar: str, param: str) -> "Constraint":
        """One answer's constraint to `grammar` (from `json_grammar`): each answer needs its own."""
        matcher = llguidance.LLMatcher(self._ll(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"'{param}' cannot be compiled into a grammar: {matcher.get_error()}", param)
        return Constraint(matcher, self._tokenizer.vocab_size)


class Constraint:
    """One answer's grammar state: `allowed()` before each choice, `consume(token)` after."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        """A bool per token of the model's vocabulary."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(words, bitorder="little")[: self.vocab_size].astype(bool))

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed: "
                               f"{self.matcher.get_error()}")
