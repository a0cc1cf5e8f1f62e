"""A conversation over a session whose KV cache holds the turns so far.

Each turn hands the session the whole transcript: the tokens of every earlier turn, exactly
as the model read and wrote them, then the end of the previous answer, the new user message
and the assistant header (`ChatFormat.continuation`). `render(all turns)` equals that, so the
model sees what a fresh run of the transcript would, and the session prefills only what its
cache does not hold yet. When a turn would not fit in the context, the oldest exchanges are
dropped and the rest is rendered again (the session still reuses whatever prefix is unchanged).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from llama_base.errors import PromptError
from llama_runtime.generation.sampling import SamplingParams
from llama_runtime.generation.session import GenerationResult, Session


@dataclass
class Conversation:
    session: Session
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    transcript: list[int] = field(default_factory=list)  # every turn's tokens so far, answers as generated
    notices: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.messages.clear()
        self.transcript.clear()

    def _full_prompt(self) -> list[int]:
        fmt = self.session.tokenizer.chat
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return fmt.render(head + self.messages)

    def ask(self, text: str, n_tokens: int, on_text: Callable[[str], None] | None = None,
            sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (),
            constraint=None) -> GenerationResult:
        """The answer to `text`, the next user message; `stop` and `constraint` (a fresh
        constrained.Constraint for this answer) as `Session.generate` takes them."""
        if not text or not text.strip():
            raise PromptError("the message is empty")
        fmt = self.session.tokenizer.chat
        if fmt is None:
            raise PromptError("this model has no chat format; use a single prompt instead")
        limit = self.session.model.max_context
        self.messages.append({"role": "user", "content": text})
        prompt = self.transcript + fmt.continuation(text) if self.transcript else self._full_prompt()
        # Keep room for at least one generated token; otherwise forget the oldest exchanges.
        while len(prompt) >= limit and len(self.messages) > 1:
            self.messages = self.messages[2:] if len(self.messages) > 2 else self.messages[-1:]
            self.notices.append("context full: dropped the oldest exchange and re-read the rest")
            prompt = self._full_prompt()
        if len(prompt) >= limit:
            self.messages.pop()
            raise PromptError(f"the message needs {len(prompt)} tokens; the context limit is {limit}")
        try:
            result = self.session.generate(prompt, n_tokens, on_text, sampling, constraint=constraint, stop=stop)
        except BaseException:
            self.messages.pop()
            raise
        self.transcript = prompt + result.tokens
        self.messages.append({"role": "assistant", "content": result.text})
        return result
