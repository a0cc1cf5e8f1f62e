"""What a bench run measures: prompt lengths, decode steps, repetitions, and the prompt ids.

The full plan: TTFT at 32/128/512/2048 prompt tokens, 64 decode tokens after
the 128-token prompt, 3 timed runs of every measurement. The runs are spread over rounds: in
each round every runtime is started once and times each measurement after one warm-up, and the
runtimes take turns round by round. The hosts this runs on share their memory system with
other guests, and its bandwidth drifts by half over minutes; taking turns exposes every runtime
to the same drift, where three back-to-back runs would hand one runtime a fast stretch and the
next a slow one. The quick plan is a smoke run of the same code paths (used by the tests),
small enough for seconds, not minutes.

Prompts are token ids built once by the model's own tokenizer from one fixed text (repeated,
then cut to length), and every runtime gets exactly those ids: no runtime tokenizes, so no
tokenizer difference can change a prompt's length or content.

A TTFT of a short prompt takes about a second, so one hiccup of the host (it shares its cores as
well as its memory) moves a single run by a fifth or more; those are timed `short_runs` times
per round, which costs seconds and gives a median of nine. Decode is timed after the first of
them only, as for every other length.

With `quant="q4nx"` the same measurements compare our 4-bit weights with llama.cpp's 4-bit
types (Q4_0, Q4_1, Q4_K_M) and with our own bf16 weights. Perplexity (`verify.eval_text`, the
same chunks for every runtime) is scored once per runtime after the rounds, untimed, on models
with trained weights.

The bandwidth also jumps within seconds, which rounds minutes apart cannot pair up: after the
rounds, `turns` turns of `turn_steps` decode steps per runtime, all runtimes loaded and taking
turns burst by burst (`bench.turns`), give the decode figures and ratios; the rounds' decode
runs stay in the report beside them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.bandwidth import GIB
from llama32_1b_inference import DEFAULT_MAX_CONTEXT
from llama_base.config import LlamaConfig
from llama_runtime.text.tokenizer import Tokenizer
from verify.eval_text import CHUNK_LEN, N_CHUNKS

# The llama.cpp file types each of our weight formats is measured against.
GGUF_TYPES = {"bf16": ("bf16", "q8_0"), "q4nx": ("q4_0", "q4_1", "q4_k_m")}

PROMPT_TEXT = (
    "The history of computing is a story of moving data as much as of computing on it. Early machines "
    "kept their programs on punched cards and their numbers in rotating drums; later ones stored both "
    "in the same fast memory, and the speed of that memory soon set the pace of everything else. Today "
    "a processor can multiply far faster than it can fetch the numbers it multiplies, so the engineers "
    "who build language models count bytes as carefully as arithmetic: a model that reads its weights "
    "once per word can never answer faster than its memory can deliver them."
)


@dataclass(frozen=True)
class Plan:
    prompt_lengths: tuple[int, ...] = (32, 128, 512, 2048)
    decode_length: int = 128          # the prompt the decode steps follow
    n_decode: int = 64
    rounds: int = 3                   # runtimes take turns this many times
    runs: int = 1                     # timed runs per measurement in each round
    short_runs: int = 3               # ... but this many TTFT runs for prompts up to short_limit tokens
    short_limit: int = 512
    warmup: int = 1
    turns: int = 12                   # decode turns after the rounds (bench.turns); 0: none
    turn_steps: int = 16              # decode steps per runtime per turn
    max_context: int = DEFAULT_MAX_CONTEXT   # our KV cache and llama.cpp's n_ctx: the same positions
    bandwidth_bytes: int = GIB
    quant: str = "bf16"               # our weight format (GGUF_TYPES names llama.cpp's peers for it)
    decode: str = "auto"              # our decode (`DeviceModel`'s DECODE: auto, layers or fused)
    gguf_types: tuple[str, ...] = GGUF_TYPES["bf16"]
    perplexity_chunks: int = N_CHUNKS  # 0: no perplexity
    perplexity_len: int = CHUNK_LEN
    quick: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.decode_length not in self.prompt_lengths:
            raise ValueError("the decode prompt must be one of the measured prompt lengths")
        if self.turns and not 0 < self.turn_steps <= self.n_decode:
            raise ValueError("a decode turn's steps must be among the n_decode positions the rounds time")
        if max(self.prompt_lengths) + self.n_decode >= self.max_context:
            raise ValueError("the longest prompt plus its decode steps must fit the context")

    def to_dict(self) -> dict:
        return asdict(self)

    def for_quant(self, quant: str) -> "Plan":
        """This plan for our weights in `quant`, against llama.cpp's types of that class."""
        types = GGUF_TYPES[quant]
        return replace(self, quant=quant, gguf_types=types[:len(self.gguf_types)] if self.quick else types)


FULL = Plan()
QUICK = Plan(prompt_lengths=(32,), decode_length=32, n_decode=4, rounds=2, runs=1, short_runs=1, warmup=1,
             turns=2, turn_steps=2,
             max_context=128,
             bandwidth_bytes=GIB // 4, gguf_types=GGUF_TYPES["bf16"][:1], perplexity_chunks=1, perplexity_len=32,
             quick=True,
             notes=("quick smoke run: fewer, shorter measurements and a 256 MiB bandwidth matrix; "
                    "not a benchmark result",))


def prompt_ids(folder: Path, cfg: LlamaConfig, lengths: tuple[int, ...]) -> dict[int, list[int]]:
    """For each length, exactly that many ids: the text with BOS as the tokenizer adds it, then repeats."""
    tok = Tokenizer(folder, cfg)
    head = tok.encode_prompt(PROMPT_TEXT, chat=False)
    body = tok.encode_text(" " + PROMPT_TEXT)
    out = {}
    for n in lengths:
        ids = list(head)
        while len(ids) < n:
            ids += body
        out[n] = tok.check_ids(ids[:n])
    return out
