"""The runtime users drive: a `Session` (model on a device + tokenizer) and `generate()`.

`build_session` resolves the checkpoint (falling back to the embedded model when Llama
weights are absent), opens the device (NPU through pyxrt, else the simulated NPU), compiles
or loads every kernel group through the KernelCache, uploads each layer's weights once, and
builds the RoPE table and KV cache. `tokens` generates an answer as tokens (tokens.py:
prefill, then decode step by step); `generate` reads them as text, streaming BPE-safe pieces
as they are produced, with their log probabilities and timings, and says why it stopped.
"""
from __future__ import annotations

import ctypes
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from cpu_kernels import threads as host_threads
from llama_base.errors import CheckpointError, PromptError
from llama_runtime.checkpoints.loader import check_fits, load_weights
from llama_runtime.engine.device_model import DeviceModel, choose_decode, rms_norm
from llama_runtime.engine.prefill import prefill
from llama_runtime.engine.kv_cache import context_positions
from llama_runtime.generation.logprobs import TokenLogprob, score
from llama_runtime.checkpoints.resolve import ResolvedModel, resolve_model
from llama_runtime.generation.processors import processors_for
from llama_runtime.generation.sampling import Sampler, SamplingParams
from llama_runtime.generation.stops import StopText
from llama_runtime.generation.tokens import TokenStream, read_prompt
from llama_runtime.text.tokenizer import StreamDecoder, Tokenizer
from multi_launch_builder.shape_check import check_tiles
from npu_runtime.api import Device
from npu_runtime.cache import KernelCache
from npu_runtime.devices import open_device
from npu_runtime.profiler import NULL_PROFILER, Profiler


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    stop_reason: str            # end_token | stop_string | n_tokens | context_limit | interrupted | cancelled
    ttft_s: float = 0.0         # prompt in → first token chosen
    decode_s: float = 0.0
    cached: int = 0             # positions now in the KV cache (prompt + every token fed back)
    prefill_tokens: int = 0     # tokens this call prefilled (the prompt past the reused prefix)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # one per token, if asked
    stop_string: str | None = None   # the one that ended the answer (stop reason "stop_string")

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

    @property
    def config(self):
        return self.model.config

    def encode(self, prompt: str, chat: bool | None = None, system: str | None = None) -> list[int]:
        if not prompt or not prompt.strip():
            raise PromptError("the prompt is empty")
        use_chat = self.chat if chat is None else chat
        return self.tokenizer.encode_prompt(prompt, chat=use_chat, system=system)

    def tokens(self, prompt_ids: list[int], n_tokens: int, sampling: SamplingParams = SamplingParams(),
               constraint=None, should_stop: Callable[[], bool] | None = None,
               reuse_cache: bool = True) -> TokenStream:
        """The answer to `prompt_ids` as tokens, each with the logits it was chosen from
        (tokens.TokenStream); `generate` reads it as text."""
        return TokenStream(self.model, prompt_ids, n_tokens, processors_for(sampling, constraint), Sampler(sampling),
                           self.tokenizer.end_token_ids, should_stop, reuse_cache, self.profiler)

    def generate(self, prompt: str | list[int], n_tokens: int = 32, on_text: Callable[[str], None] | None = None,
                 sampling: SamplingParams = SamplingParams(), chat: bool | None = None,
                 should_stop: Callable[[], bool] | None = None, logprobs: int | None = None,
                 on_logprob: Callable[[TokenLogprob], None] | None = None,
                 constraint=None, reuse_cache: bool = True, stop: Sequence[str] = ()) -> GenerationResult:
        """Answer `prompt` (text, or token ids used as given): prefill it, then decode.

        The prompt is the whole context (a chat turn passes the transcript so far). With
        `reuse_cache`, only the tokens past the longest prefix already in the KV cache are
        prefilled; without it, all of them (a fresh run). Generation stops at an end token,
        where the text first shows one of the `stop` strings (the text ends before it, and
        the streamed pieces never show any of it: stops.py), after `n_tokens`, or at the
        context limit; Ctrl-C stops it too and returns what was produced, and so does
        `should_stop` returning True (checked once per token; stop reason "cancelled").

        `logprobs` = k (0 or more) scores every generated token with its k most likely
        alternatives (`on_logprob` gets each before its text). `constraint`
        (constrained.Constraint) masks, before each choice, the tokens its grammar forbids
        (processors.py: after the repetition penalty and the logit bias).
        """
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else self.encode(prompt, chat)
        stream = self.tokens(ids, n_tokens, sampling, constraint, should_stop, reuse_cache)
        decoder, cut = StreamDecoder(self.tokenizer), StopText(stop)
        scored: list[TokenLogprob] = []

        def show(piece: str) -> None:
            shown = cut.push(piece)
            if shown and on_text:
                on_text(shown)

        reason, ttft = None, 0.0
        t0 = time.perf_counter()
        t_first = t0
        steps = iter(stream)
        try:
            for step in steps:
                if len(stream.tokens) == 1:
                    t_first = time.perf_counter()
                    ttft = t_first - t0
                if logprobs is not None:
                    scored.append(score(step.logits, step.token, logprobs))
                    if on_logprob:
                        on_logprob(scored[-1])
                show(decoder.push(step.token))
                if cut.hit:
                    reason = "stop_string"
                    break
        except KeyboardInterrupt:
            reason = "interrupted"
        finally:
            steps.close()
        out = stream.tokens
        reason = reason or stream.stop_reason
        if not out and reason == "end_token":     # the first token chosen ended the answer
            ttft = time.perf_counter() - t0
        # Cut short (budget, context, cancel), the last tokens may hold part of a character:
        # those bytes are dropped rather than shown as U+FFFD, in the stream and in `text`.
        show(decoder.flush(keep_partial=reason == "end_token"))
        held = cut.finish()             # what could have begun a stop string, and did not
        if held and on_text:
            on_text(held)
        if cut.hit:
            text = cut.text             # what was streamed: the answer up to the stop string
        else:
            text = self.tokenizer.decode(out)
            if reason != "end_token":
                text = text.rstrip("\ufffd")
        decode_s = time.perf_counter() - t_first if out else 0.0
        return GenerationResult(text, out, len(ids), reason, ttft, decode_s,
                                cached=stream.cached, prefill_tokens=stream.prefill_tokens, logprobs=scored,
                                stop_string=cut.matched)

    def score_prompt(self, ids: list[int], k: int, sampling: SamplingParams = SamplingParams()
                     ) -> list[TokenLogprob | None]:
        """Each prompt token's log probability given the ones before it (None for the first),
        with the `k` likeliest alternatives, shaped by `sampling` as generated tokens are.

        The prompt is read one decode step at a time (tokens.read_prompt); all but its last
        token end up in the cache, so a `generate(ids)` that follows prefills only that one.
        """
        if not ids or len(ids) >= self.model.max_context:
            raise PromptError(f"the prompt must have 1 to {self.model.max_context - 1} tokens to be scored")
        shaped = read_prompt(self.model, ids, processors_for(sampling))
        return [None] + [score(logits, tok, k) for logits, tok in zip(shaped, ids[1:])]

    def embed(self, ids: list[int]) -> torch.Tensor:
        """The text's vector (f32, hidden size): the final-normed hidden state of every position,
        averaged, scaled to length 1 as OpenAI's embeddings are. A causal model's last position
        alone sees the whole text, but it is shaped to predict the next token; the mean weighs
        every token alike. The prompt is prefilled with every row through every layer (a
        capture hook), so the KV cache then holds exactly `ids`."""
        m = self.model
        if not ids or len(ids) > m.max_context:
            raise PromptError(f"the input must have 1 to {m.max_context} tokens, not {len(ids)}")
        last, rows = m.config.num_hidden_layers - 1, []

        def capture(layer: int, name: str, t: torch.Tensor) -> None:
            if layer == last and name == "out":
                rows.append(t)

        prefill(m, ids, 0, capture)
        hidden = torch.cat(rows)[: len(ids)]
        mean = rms_norm(hidden, m.final_norm, m.config.rms_norm_eps).float().mean(dim=0)
        return mean / mean.norm().clamp_min(1e-12)


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
                  log: Callable[[str], None] = print, quant: str = "bf16", decode: str = "auto",
                  threads: int | None = None) -> Session:
    """Load the model, open the device, compile or load every group and upload the weights.
    `model` is resolved once, here, unless it already is (a checker's, whose reference loads
    the same folder; whoever resolves it says why a fallback replaced it); `device` is a kind
    (`devices.DEVICE_KINDS`), or a device already opened (a checker's configured one, or the
    server's, opened before it listens), whose opener has said which it is. `decode`:
    "layers", "fused" or "auto" (`choose_decode`). `threads`: the host kernels' team, fixed
    (`cpu_kernels.threads`); None adapts it to the free cores.

    Ends by freezing what the process holds in the garbage collector's permanent generation:
    torch, the tokenizer and the model are some 300 000 long-lived objects, and a full
    collection over them stops generation for 0.1–0.2 s wherever it happens to fall (inside
    a prefill, between two tokens). Frozen, they are skipped; what generation allocates is
    still collected.
    """
    t0 = time.perf_counter()
    host_threads.configure(threads)
    # The device first: asking for an NPU that is not there is an error before anything loads.
    dev = open_device(device, verbose=True) if isinstance(device, str) else device   # its opener said which
    resolved = model
    if not isinstance(resolved, ResolvedModel):
        resolved = resolve_model(model, log, quant)
        if resolved.fallback_note:
            log(f"[model] {resolved.fallback_note}")   # the reason says how to get the weights
    ctx = context_positions(resolved.config, max_context)   # before any weight loads
    problem = check_tiles(resolved.config, quant)
    if problem:
        raise CheckpointError(f"{resolved.name}: its shapes do not tile onto the NPU's groups: {problem}")
    check_fits(resolved, quant)
    weights = load_weights(resolved, quant, log)
    cfg = weights.config
    log(f"[model] {resolved.name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{weights.nbytes() / 1e9:.2f} GB {weights.quant} ({resolved.folder})")
    tokenizer = Tokenizer(resolved.folder, cfg)
    prof = Profiler() if profile else NULL_PROFILER
    kc = KernelCache(dev, cache_dir, profiler=prof, allow_compile=allow_compile)
    dm = DeviceModel(kc, weights, ctx, buckets=buckets, profiler=prof, decode=choose_decode(decode))
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

