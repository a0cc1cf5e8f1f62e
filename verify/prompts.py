"""Prompt sets for the gate: questions for chat models, text openings for base models.

Prompts are chosen to produce long, varied answers (facts, lists, code, arithmetic, a
translation) so 32 greedy steps exercise many positions and token kinds rather than ending
after a one-word reply. A chat model's prompts go through its chat format, as in `make run`.
The first prompt of each set is the one `make verify` and the diagnosis always include.
"""
from __future__ import annotations

from verify import VerifyError

INSTRUCT_PROMPTS = (
    "What is the capital of Japan? Tell me a little about the city.",
    "Explain in a short paragraph why the sky is blue.",
    "List five common fruits and one fact about each.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 multiplied by 23? Explain each step of the calculation.",
    "Translate into French: The weather is nice today and we are going to the beach.",
    "Give three tips for writing clear technical documentation.",
    "Describe the water cycle to a ten-year-old.",
)

BASE_PROMPTS = (
    "The capital of Japan is Tokyo, a city known for",
    "The sky appears blue during the day because",
    "Here is a list of five common fruits:\n1.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "To multiply 17 by 23, we first",
    "The water cycle describes how water moves between the oceans, the air and the land.",
    "Three tips for writing clear technical documentation are",
    "Once upon a time, in a small village by the sea,",
)


def prompt_set(chat: bool, count: int) -> tuple[str, ...]:
    """The first `count` prompts of the set for a chat (instruct) or base model."""
    prompts = INSTRUCT_PROMPTS if chat else BASE_PROMPTS
    if not 1 <= count <= len(prompts):
        raise VerifyError(f"--prompts must be between 1 and {len(prompts)} (got {count})")
    return prompts[:count]
