"""Log probabilities of chosen tokens, and their most likely alternatives, for OpenAI's
`logprobs` fields.

They are taken from the logits the sampler chooses from (after the repetition penalty and
`logit_bias`, before temperature and top-p), as a log-softmax in float32: what a client reads
is then the model's distribution as this request shaped it, and does not change with the
temperature it samples at. Only requests that ask for them pay for the log-softmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

MAX_TOP_CHAT = 20          # OpenAI's limit for chat `top_logprobs`
MAX_TOP_COMPLETIONS = 5    # and for completions `logprobs`


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # the `k` most likely ids, most likely first


def score(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """`token`'s log probability under `logits`, and the `k` most likely tokens'."""
    lp = torch.log_softmax(logits.float(), -1)
    top = ()
    if k:
        values, ids = torch.topk(lp, min(k, lp.numel()))
        # Tokens a grammar masked out have no probability at all: they are not alternatives
        # (and -inf is not JSON).
        top = tuple((i, v) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf"))
    return TokenLogprob(int(token), float(lp[token]), top)


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's, also Llama 3's and SmolLM2's): bytes that are
    printable stand for themselves, the others are shifted past U+0100 in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shift)] = b
            shift += 1
    return table


class TokenText:
    """A token's text and raw bytes as the API shows them. A token may hold part of a UTF-8
    character, so its bytes come from its vocabulary entry, not from decoding it alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._control = set(tokenizer.added_vocab().values())

    def bytes(self, token: int) -> list[int]:
        entry = self.tokenizer.id_to_token(token) or ""
        table = _byte_of_char()
        if entry and all(c in table for c in entry) and token not in self._control:
            return [table[c] for c in entry]
        return list(self.tokenizer.decode([token]).encode())

    def text(self, token: int) -> str:
        return bytes(self.bytes(token)).decode("utf-8", errors="replace")

    # ---- OpenAI's two shapes ----
    def chat_content(self, entries: list[TokenLogprob]) -> list[dict]:
        """`choices[].logprobs.content` of a chat answer."""
        def one(tok: int, lp: float) -> dict:
            return {"token": self.text(tok), "logprob": lp, "bytes": self.bytes(tok)}
        return [one(e.token, e.logprob) | {"top_logprobs": [one(t, l) for t, l in e.top]} for e in entries]

    def completion(self, entries: list[TokenLogprob | None], tokens: list[int], offset: int) -> dict:
        """`choices[].logprobs` of a completion: one row per token, `None` where a token has no
        score (the first prompt token under `echo`); text offsets count from `offset`."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, e in zip(tokens, entries):
            text = self.text(tok)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if e is None else e.logprob)
            out["top_logprobs"].append(None if e is None else {self.text(t): l for t, l in e.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out
