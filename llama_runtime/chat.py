"""A conversation that keeps its KV cache between turns.

Each turn prefills only the tokens that are not cached yet: the end of the previous answer,
the new user message and the assistant header (`ChatFormat.continuation`), at the offset
where the cache ends. `render(all turns)` equals the cached tokens plus that continuation,
so the model sees exactly what a fresh run of the whole transcript would. When a turn would
not fit in the context, the oldest exchanges are dropped and the rest is prefilled again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from llama_base.errors import PromptError
from llama_runtime.sampling import SamplingParams


@dataclass
class Conversation:
    session: object
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)     # tokens whose K/V are in the cache, in order
    pending: list[int] = field(default_factory=list)    # generated but never fed back (the last answer's tail)
    notices: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.messages.clear()
        self.tokens.clear()
        self.pending.clear()

    def _full_prompt(self) -> list[int]:
        fmt = self.session.tokenizer.chat
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return fmt.render(head + self.messages)

    def ask(self, text: str, n_tokens: int, on_text: Callable[[str], None] | None = None,
            sampling: SamplingParams = SamplingParams()):
        if not text or not text.strip():
            raise PromptError("the message is empty")
        fmt = self.session.tokenizer.chat
        if fmt is None:
            raise PromptError("this model has no chat format; use a single prompt instead")
        limit = self.session.model.max_context
        self.messages.append({"role": "user", "content": text})
        if self.tokens:
            new, start = self.pending + fmt.continuation(text), len(self.tokens)
        else:
            new, start = self._full_prompt(), 0
        # Keep room for at least one generated token; otherwise forget the oldest exchanges.
        while start + len(new) >= limit and len(self.messages) > 1:
            self.messages = self.messages[2:] if len(self.messages) > 2 else self.messages[-1:]
            self.notices.append("context full: dropped the oldest exchange and re-read the rest")
            new, start = self._full_prompt(), 0
        if start + len(new) >= limit:
            self.messages.pop()
            raise PromptError(f"the message needs {len(new)} tokens; the context limit is {limit}")
        history = self.tokens[:start]
        try:
            result = self.session.generate(new, n_tokens, on_text, sampling, start=start, history=history)
        except BaseException:
            self.messages.pop()
            raise
        fed = result.cached - start                # new tokens and answer tokens now in the cache
        stream = new + result.tokens
        self.tokens = history + stream[:fed]
        self.pending = stream[fed:]
        self.messages.append({"role": "assistant", "content": result.text})
        return result
