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

Decode at depth: for each of `depths` (1K to 32K positions) a prompt of exactly that many ids
(the same fixed text, repeated) is prefilled, its TTFT timed, then `depth_decode` greedy decode
steps after it, for our runtime and llama.cpp in the same weights class. Every (depth, runtime)
is a child of its own, and the runtimes take turns depth by depth, round by round
(`depth_rounds`); a child first warms up untimed on the prompt's first `depth_warmup_tokens` ids
and `depth_warmup_steps` decode steps, since a whole second prefill of 32K positions would
double the sweep. Our KV cache holds the deepest depth plus its decode steps in every child
(its pages are committed only as they are written), llama.cpp's n_ctx each child's own depth
plus its steps. Depths past a model's `max_position_embeddings` are skipped with the reason.
The TTFT targets are read at `depth_ttft_targets`. `only_depth` keeps the sweep alone.

Under load (`bench.load`): in each of `load_rounds` rounds, the decode-length prompt's TTFT and
the decode steps after it, ours and its llama.cpp peer, with one core (and half of them, on
machines with four CPUs or more) held by busy loops; and ours on one thread, idle.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.bandwidth import GIB
from llama32_1b_inference import DEFAULT_MAX_CONTEXT
from llama_base.config import LlamaConfig
from llama_runtime.engine.device_model import DECODE_MODES
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
    gguf_types: tuple[str, ...] = GGUF_TYPES["bf16"]
    perplexity_chunks: int = N_CHUNKS  # 0: no perplexity
    perplexity_len: int = CHUNK_LEN
    decode: str = "auto"              # our decode (`build_session`'s): auto, layers or fused
    depths: tuple[int, ...] = (1024, 4096, 8192, 16384, 32768)   # decode at depth; () leaves it out
    depth_decode: int = 64            # decode steps timed after each depth's prompt
    depth_rounds: int = 3
    depth_warmup_tokens: int = 128    # each depth child's untimed warm-up: a prompt this long ...
    depth_warmup_steps: int = 8       # ... and this many decode steps after it
    depth_ttft_targets: tuple[int, ...] = (8192, 32768)   # the depths whose TTFT has a target
    depth_only: bool = False          # the depth sweep alone: no rounds, turns or perplexity (`only_depth`)
    load_rounds: int = 3              # rounds under load (`bench.load`); 0 leaves the section out
    quick: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.decode_length not in self.prompt_lengths:
            raise ValueError("the decode prompt must be one of the measured prompt lengths")
        if self.turns and not 0 < self.turn_steps <= self.n_decode:
            raise ValueError("a decode turn's steps must be among the n_decode positions the rounds time")
        if max(self.prompt_lengths) + self.n_decode >= self.max_context:
            raise ValueError("the longest prompt plus its decode steps must fit the context")
        if self.decode not in ("auto",) + DECODE_MODES:
            raise ValueError(f"decode {self.decode!r}: expected auto or one of {', '.join(DECODE_MODES)}")
        if list(self.depths) != sorted(set(self.depths)) or any(d < 1 for d in self.depths):
            raise ValueError("the depths must be positive and in increasing order, each once")
        if self.depths and not (self.depth_decode > 0 and self.depth_rounds > 0):
            raise ValueError("a depth sweep times at least one decode step in at least one round")
        if not 0 <= self.depth_warmup_steps <= self.depth_decode:
            raise ValueError("a depth child's warm-up steps must be among the positions its decode times")
        if not set(self.depth_ttft_targets) <= set(self.depths):
            raise ValueError("a TTFT target's depth must be one of the depths")
        if self.load_rounds < 0:
            raise ValueError("the rounds under load are a count: 0 leaves them out")
        if self.depth_only and not self.depths:
            raise ValueError("a depth-only run needs at least one depth")

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
             depths=(64, 256), depth_decode=8, depth_rounds=2, depth_warmup_tokens=32, depth_warmup_steps=2,
             depth_ttft_targets=(256,), load_rounds=1,
             bandwidth_bytes=GIB // 4, gguf_types=GGUF_TYPES["bf16"][:1], perplexity_chunks=1, perplexity_len=32,
             quick=True,
             notes=("quick smoke run: fewer, shorter measurements and a 256 MiB bandwidth matrix; "
                    "not a benchmark result",))


def with_depths(plan: Plan, depths: tuple[int, ...]) -> Plan:
    """`plan` sweeping `depths` instead (sorted, each once), its TTFT targets kept where still measured."""
    depths = tuple(sorted(set(depths)))
    return replace(plan, depths=depths, depth_ttft_targets=tuple(d for d in plan.depth_ttft_targets if d in depths))


def only_depth(plan: Plan) -> Plan:
    """`plan` reduced to its decode-at-depth sweep, for a run of minutes where the whole bench
    takes an hour: no rounds, turns or perplexity, so nothing measures which of llama.cpp's
    types of the weights class decodes fastest, and the sweep's peer is the class's first
    (bf16 for bf16; for 4-bit, Q4_0, whose weights llama.cpp repacks for its x86 kernels), the
    only one converted."""
    return replace(plan, depth_only=True, gguf_types=GGUF_TYPES[plan.quant][:1], load_rounds=0)


def with_types(plan: Plan, types: tuple[str, ...]) -> Plan:
    """`plan` against only these of llama.cpp's types of its weights class, in the class's order.

    Each type converted and run costs a model's whole rounds again: at 8B on two cores about
    twenty minutes for a fast type and an hour for Q4_1, which ran at half Q4_0's decode rate in
    the 3B's run. Every ratio is taken against the fastest of the types measured, and the
    report's tables name them."""
    allowed = GGUF_TYPES[plan.quant]
    unknown = [t for t in types if t not in allowed]
    if unknown or not types:
        raise ValueError(f"llama.cpp types {', '.join(unknown) or '(none)'}: with {plan.quant} weights "
                         f"the peers are {', '.join(allowed)}")
    return replace(plan, gguf_types=tuple(t for t in allowed if t in types))


def depth_label(depth: int) -> str:
    """1024 → "1K", 32768 → "32K", 64 → "64"."""
    return f"{depth // 1024}K" if depth >= 1024 and depth % 1024 == 0 else str(depth)


def split_depths(plan: Plan, cfg: LlamaConfig, model: str) -> tuple[tuple[int, ...], dict[int, str]]:
    """The plan's depths `model` can hold with their decode steps after them, and for each other
    the reason it is skipped."""
    limit = cfg.max_position_embeddings
    kept, skipped = [], {}
    for d in plan.depths:
        if d + plan.depth_decode > limit:
            skipped[d] = (f"{d} positions and {plan.depth_decode} decode steps after them exceed {model}'s "
                          f"max_position_embeddings of {limit}")
        else:
            kept.append(d)
    return tuple(kept), skipped


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
