"""The runtime users drive: a `Session` (model on a device + tokenizer) and `generate()`.

`build_session` resolves the checkpoint (falling back to the embedded model when Llama
weights are absent), opens the device (NPU through pyxrt, else the simulated NPU), compiles
or loads every kernel group through the KernelCache, uploads each layer's weights once, and
builds the RoPE table and KV cache. `generate` prefills the prompt, then decodes token by
token, streaming BPE-safe text as it is produced and stopping at an end token, at the token
budget or at the context limit, and says which.
"""
from __future__ import annotations

import ctypes
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from llama_base.errors import PromptError
from llama_runtime.checkpoints.loader import load_weights
from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.device_model import DeviceModel
from llama_runtime.generation.logprobs import TokenLogprob, score
from llama_runtime.checkpoints.resolve import ResolvedModel, resolve_model
from llama_runtime.engine.prefill import prefill
from llama_runtime.generation.sampling import Sampler, SamplingParams
from llama_runtime.text.tokenizer import StreamDecoder, Tokenizer
from npu_runtime.api import Device
from npu_runtime.cache import KernelCache
from npu_runtime.devices import open_device
from npu_runtime.profiler import NULL_PROFILER, Profiler

DEFAULT_MAX_CONTEXT = 4096


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    stop_reason: str            # end_token | n_tokens | context_limit | interrupted | cancelled
    ttft_s: float = 0.0         # prompt in → first token chosen
    decode_s: float = 0.0
    cached: int = 0             # positions now in the KV cache (prompt + every token fed back)
    prefill_tokens: int = 0     # tokens this call prefilled (the prompt past the reused prefix)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # one per token, if asked

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(len(self.tokens) - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose K/V came from the cache instead of a prefill."""
        return self.prompt_tokens - self.prefill_tokens


@dataclass
class Session:
    """One model on one device, and the one KV cache its generations share.

    The cache records which token sits at each position it holds (`cached_ids`), so a prompt
    that begins with them (the next turn of a chat, the same system prompt, a repeated
    request) prefills only the rest: callers hand the whole prompt and keep no cache state.
    """
    resolved: ResolvedModel
    model: DeviceModel
    tokenizer: Tokenizer
    device: Device
    kc: KernelCache
    profiler: Profiler
    chat: bool
    build_s: float = 0.0

    @property
    def cached_ids(self) -> list[int]:
        """The token at each KV cache position that holds valid K/V, from position 0."""
        return list(self.model.kv.token_ids)

    def reusable(self, ids: list[int]) -> int:
        """Length of the cached prefix `ids` can keep. The last prompt token is always
        prefilled: its logits are what the first answer token is chosen from."""
        cached = self.model.kv.token_ids
        n, limit = 0, min(len(cached), len(ids) - 1)
        while n < limit and cached[n] == ids[n]:
            n += 1
        return n

    @property
    def config(self):
        return self.model.config

    def encode(self, prompt: str, chat: bool | None = None, system: str | None = None) -> list[int]:
        if not prompt or not prompt.strip():
            raise PromptError("the prompt is empty")
        use_chat = self.chat if chat is None else chat
        return self.tokenizer.encode_prompt(prompt, chat=use_chat, system=system)

    def generate(self, prompt: str | list[int], n_tokens: int = 32, on_text: Callable[[str], None] | None = None,
                 sampling: SamplingParams = SamplingParams(), chat: bool | None = None,
                 should_stop: Callable[[], bool] | None = None, logprobs: int | None = None,
                 on_logprob: Callable[[TokenLogprob], None] | None = None,
                 constraint=None, reuse_cache: bool = True) -> GenerationResult:
        """Answer `prompt` (text, or token ids used as given): prefill it, then decode.

        The prompt is the whole context (a chat turn passes the transcript so far). With
        `reuse_cache`, only the tokens past the longest prefix already in the KV cache are
        prefilled; without it, all of them (a fresh run). Generation stops at an end token,
        after `n_tokens`, or at the context limit; Ctrl-C stops it too and returns what was
        produced, and so does `should_stop` returning True (checked once per token; stop
        reason "cancelled").

        `logprobs` = k (0 or more) scores every generated token with its k most likely
        alternatives (`on_logprob` gets each before its text). `constraint`
        (constrained.Constraint) masks, before each choice, the tokens its grammar forbids.
        """
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
            raise PromptError(f"the number of tokens to generate must be a positive integer (got {n_tokens!r})")
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else self.encode(prompt, chat)
        if not ids:
            raise PromptError("the prompt is empty")
        limit = self.model.max_context
        if len(ids) >= limit:
            raise PromptError(f"the prompt needs {len(ids)} positions and leaves no room to generate: "
                              f"the context limit is {limit} (raise it with --max-context)")
        start = self.reusable(ids) if reuse_cache else 0
        new = ids[start:]
        sampler = Sampler(sampling, constraint)
        decoder = StreamDecoder(self.tokenizer)
        ends = self.tokenizer.end_token_ids
        out: list[int] = []
        scored: list[TokenLogprob] = []
        t0 = time.perf_counter()
        pos, reason, ttft, t_first = start, "n_tokens", 0.0, t0
        try:
            logits = prefill(self.model, new, start=start)
            pos = len(ids)
            while True:
                with self.profiler.host_op("sampling"):
                    tok = sampler(logits, ids + out)
                if not out:
                    t_first = time.perf_counter()
                    ttft = t_first - t0
                if tok in ends:
                    reason = "end_token"
                    break
                out.append(tok)
                if logprobs is not None:
                    scored.append(score(sampler.last_logits, tok, logprobs))
                    if on_logprob:
                        on_logprob(scored[-1])
                piece = decoder.push(tok)
                if piece and on_text:
                    on_text(piece)
                if len(out) >= n_tokens:
                    break
                if pos >= limit:
                    reason = "context_limit"
                    break
                if should_stop is not None and should_stop():
                    reason = "cancelled"
                    break
                logits = decode_step(self.model, tok, pos)
                pos += 1
        except KeyboardInterrupt:
            reason = "interrupted"
        # Cut short (budget, context, cancel), the last tokens may hold part of a character:
        # those bytes are dropped rather than shown as U+FFFD, in the stream and in `text`.
        tail = decoder.flush(keep_partial=reason == "end_token")
        if tail and on_text:
            on_text(tail)
        text = self.tokenizer.decode(out)
        if reason != "end_token":
            text = text.rstrip("\ufffd")
        decode_s = time.perf_counter() - t_first if out else 0.0
        return GenerationResult(text, out, len(ids), reason, ttft, decode_s,
                                cached=pos, prefill_tokens=len(new), logprobs=scored)

    def score_prompt(self, ids: list[int], k: int, sampling: SamplingParams = SamplingParams()
                     ) -> list[TokenLogprob | None]:
        """Each prompt token's log probability given the ones before it (None for the first),
        with the `k` likeliest alternatives, shaped by `sampling` as generated tokens are.

        Prefill keeps only its last row's logits, so the prompt goes through decode steps one
        token at a time (slower than a prefill). All but its last token end up in the cache,
        so a `generate(ids)` that follows prefills only that one.
        """
        if not ids or len(ids) >= self.model.max_context:
            raise PromptError(f"the prompt must have 1 to {self.model.max_context - 1} tokens to be scored")
        sampler = Sampler(sampling)
        out: list[TokenLogprob | None] = [None]
        for i, t in enumerate(ids[:-1]):
            logits = decode_step(self.model, t, i)
            out.append(score(sampler.adjust(logits, ids[: i + 1]), ids[i + 1], k))
        return out


END_OF_TURN = ("<|eot_id|>", "<|im_end|>")


def is_chat_model(config, tokenizer: Tokenizer) -> bool:
    """Instruct models end their turns with an end-of-turn token; base models only end the text."""
    if tokenizer.chat is None:
        return False
    turn_ends = {tokenizer.token_id(t) for t in END_OF_TURN} - {None}
    return any(e in turn_ends for e in config.eos_token_ids)


def build_session(model: str | ResolvedModel | None = None, device: str | Device = "auto", max_context: int | None = None,
                  profile: bool = False, cache_dir: Path | None = None, allow_compile: bool = True,
                  buckets: tuple[int, ...] | None = None, chat: bool | None = None,
                  log: Callable[[str], None] = print, quant: str = "bf16") -> Session:
    """Load the model, open the device, compile or load every group and upload the weights.
    `model` is resolved once, here, unless it already is (a checker's, whose reference loads
    the same folder; whoever resolves it says why a fallback replaced it); `device` is a kind (`devices.DEVICE_KINDS`), or a device already opened (a
    checker's configured one).

    Ends by freezing what the process holds in the garbage collector's permanent generation:
    torch, the tokenizer and the model are some 300 000 long-lived objects, and a full
    collection over them stops generation for 0.1–0.2 s wherever it happens to fall (inside
    a prefill, between two tokens). Frozen, they are skipped; what generation allocates is
    still collected.
    """
    t0 = time.perf_counter()
    # The device first: asking for an NPU that is not there is an error before anything loads.
    if isinstance(device, str):
        dev = open_device(device, verbose=True)
    else:
        dev = device
        print(f"[device] {dev.name}", flush=True)
    resolved = model
    if not isinstance(resolved, ResolvedModel):
        resolved = resolve_model(model, log, quant)
        if resolved.fallback_note:
            log(f"[model] {resolved.fallback_note}")   # the reason says how to get the weights
    weights = load_weights(resolved, quant, log)
    cfg = weights.config
    log(f"[model] {resolved.name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{weights.nbytes() / 1e9:.2f} GB {weights.quant} ({resolved.folder})")
    tokenizer = Tokenizer(resolved.folder, cfg)
    prof = Profiler() if profile else NULL_PROFILER
    kc = KernelCache(dev, cache_dir, profiler=prof, allow_compile=allow_compile)
    ctx = min(max_context or DEFAULT_MAX_CONTEXT, cfg.max_position_embeddings)
    dm = DeviceModel(kc, weights, ctx, buckets=buckets, profiler=prof)
    del weights
    use_chat = is_chat_model(cfg, tokenizer) if chat is None else chat
    s = Session(resolved, dm, tokenizer, dev, kc, prof, use_chat)
    gc.collect()
    gc.freeze()
    release_free_heap()
    s.build_s = time.perf_counter() - t0
    return s


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`; elsewhere nothing).

    Loading frees more than it keeps: the tokenizer's parse of its JSON, the weights' packing
    and quantization temporaries. glibc keeps such freed memory in the process for reuse, and
    it would stay resident under everything allocated later (the prefill buffers live in
    mappings of their own and never reuse it)."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)

