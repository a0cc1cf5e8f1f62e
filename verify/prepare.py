"""What both verification commands do before and after the HF side: prompts in, our session up.

The prompts are encoded before either model exists (the HF side runs first, in a child, and
needs the ids), with the tokenizer and chat rule `build_session` uses. Once our session is
built, its own `encode` must give the same ids, so a change in how sessions encode prompts
can never leave verification checking a sequence `make run` would not feed.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llama_runtime.checkpoints.loader import load_weights
from llama_runtime.checkpoints.resolve import ResolvedModel, resolve_model
from llama_runtime.cli.options import add_model_options
from llama_runtime.generation.session import Session, build_session, is_chat_model
from llama_runtime.text.tokenizer import Tokenizer
from verify import VerifyError
from verify.prompts import prompt_set


@dataclass
class Prepared:
    model: str                  # what the user asked for
    resolved: ResolvedModel     # the checkpoint both sides load, resolved once
    tokenizer: Tokenizer
    chat: bool
    prompts: tuple[str, ...]
    prompt_ids: list[list[int]]
    end_ids: list[int]
    quant: str = "bf16"
    q4nx_folder: Path | None = None   # with QUANT=q4nx: the cached Q4NX weights both sides run

    @property
    def folder(self) -> Path:
        return self.resolved.folder

    @property
    def name(self) -> str:
        """The resolved model's name (after any fallback)."""
        return self.resolved.name

    def hf_job(self, mode: str, prompts: list[list[int]], **extra) -> dict:
        """A job for the HF reference: the checkpoint, and the quantized weights it must run
        dequantized (the numbers our kernels multiply) when there are any."""
        return {"mode": mode, "folder": str(self.folder), "prompts": prompts,
                "q4nx": str(self.q4nx_folder) if self.q4nx_folder else None, **extra}

    @property
    def label(self) -> str:
        """The model for a report heading, naming the request too when a fallback replaced it."""
        asked = f", requested `{self.model}`" if self.model != self.name else ""
        return f"`{self.name}` ({self.folder}{asked})"


def prepare(model: str, n_prompts: int, log: Callable[[str], None] = print, quant: str = "bf16") -> Prepared:
    resolved = resolve_model(model, log, quant)
    if resolved.fallback_note:
        log(f"[model] {resolved.fallback_note}")
    cfg = resolved.config
    tokenizer = Tokenizer(resolved.folder, cfg)
    chat = is_chat_model(cfg, tokenizer)
    prompts = prompt_set(chat, n_prompts)
    ids = [tokenizer.encode_prompt(p, chat=chat) for p in prompts]
    q4nx_folder = None
    if quant != "bf16":     # made (or found) now: the HF side runs first and needs the same bytes
        q4nx_folder = load_weights(resolved, quant, log).checkpoint.folder
    return Prepared(model, resolved, tokenizer, chat, prompts, ids,
                    sorted(tokenizer.end_token_ids), quant, q4nx_folder)


def build_ours(prep: Prepared, device: str, log: Callable[[str], None] = print, decode: str = "auto") -> Session:
    """The session `make run` would build, on the exact folder the HF side loaded."""
    session = build_session(prep.resolved, device=device, log=log, quant=prep.quant, decode=decode)
    log(f"[decode] {session.model.describe_decode()}")
    for prompt, ids in zip(prep.prompts, prep.prompt_ids):
        if session.encode(prompt) != ids:
            raise VerifyError(f"the session encodes {prompt!r} differently from the verification's encoding")
    return session


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The shared model flags, as both checkers read `--quant`."""
    add_model_options(parser, quant_help="our side's weight format; the HF side runs the same weights dequantized",
                      decode=True)
