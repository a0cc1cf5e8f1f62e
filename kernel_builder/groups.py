"""The kernel-group declarations: the single source of truth for what the device runs.

Each function here declares one group kind for a model config (the types are
`llama_base.group_contract`'s). A `KernelGroup` lists its argument slots (name, shape, dtype, role) and its launches (op,
parameters, slots read and written). The MLIR builders and the stitcher take their argument
maps from it, the KernelCache takes its write / skip / read sets from it, preload takes the
static tensors from it and the simulated device executes it. Shapes come only from the
`LlamaConfig` and the compiled sequence length.

Layout conventions (shared by every consumer):
- activations are row-major [rows, features]; decode activations are vectors [features];
- linear weights keep the checkpoint layout [out_features, in_features], for GEMM and GEMV
  alike, so one uploaded weight buffer serves the prefill and the decode groups of a layer
  (what a device does with it behind its BOs is its own: the simulated one packs it, see
  `weight_tiles`);
- RoPE tables are cos | sin halves per position (see `generate_rope_lut`), one row per token.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kernel_builder import backend_presets as presets
from llama_base.group_contract import DECODE_KINDS, PREFILL_KINDS, KernelGroup, Launch, Role, Slot
from llama_base.weight_formats import QUANTS
from llama_base.config import LlamaConfig


LM_HEAD_PARTITIONS = 8
# The layer weights each kind reads: what a layer's bf16-held weights (`build_group`'s `wide`)
# can change in it.
KIND_WEIGHTS: dict[str, frozenset[str]] = {
    **dict.fromkeys(("rms_gemms_rope", "rms_gemv_rope"), frozenset({"wq", "wk", "wv"})),
    **dict.fromkeys(("o_ffn", "o_gemv_ffn"), frozenset({"wo", "w_gate", "w_up", "w_down"})),
}


def _launch(name: str, op: str, reads, writes, **params) -> Launch:
    return Launch(name, op, tuple(reads), tuple(writes), tuple(sorted(params.items())))


def _slot(name: str, shape, role: Role, dtype: str = "bf16", cache_positions: bool = False) -> Slot:
    return Slot(name, tuple(int(d) for d in shape), dtype, role, cache_positions=cache_positions)


def _weight(name: str, shape, quant: str) -> Slot:
    """A linear layer's weight [out, in], held in `quant` (the group's format, or bf16 for a
    weight it keeps wide)."""
    if quant not in QUANTS:
        raise ValueError(f"unknown weight format {quant!r}: expected one of {', '.join(QUANTS)}")
    return _slot(name, shape, Role.STATIC, quant)


def _formats(quant: str, wide) -> Callable[[str], str]:
    """Each weight's format in a group of `quant` that keeps the weights named in `wide` in bf16
    (a GGUF whose author gave those more bits than 4, `q4nx_weights`)."""
    wide = frozenset(wide)
    if wide and quant == "bf16":
        raise ValueError("only a quantized group keeps weights wide")
    return lambda name: "bf16" if name in wide else quant


def matmul_op(op: str, quant: str) -> str:
    """The launch op of a GEMM or GEMV on weights in `quant`: quantized weights have kernels of
    their own (dequantization fused into the product), so they are other ops."""
    return op if quant == "bf16" else f"{op}_{quant}"


def _gemv(n: int, k: int, quant: str) -> dict:
    return presets.gemv_tiling(n, k) if quant == "bf16" else presets.gemv_q4nx_tiling(n, k)


def _group(kind: str, seq: int, slots, launches, ctx: int = 0, quant: str = "bf16") -> KernelGroup:
    if kind in PREFILL_KINDS:
        slots = [replace(s, token_major=s.role is not Role.STATIC and len(s.shape) == 2 and s.shape[0] == seq)
                 for s in slots]
    wide = tuple(s.name for s in slots if s.role is Role.STATIC and len(s.shape) == 2 and s.dtype != quant)
    g = KernelGroup(kind, seq, tuple(slots), tuple(launches), tuple(sorted(presets.group_options(kind).items())), ctx,
                    quant, tuple(sorted(wide)) if quant != "bf16" else ())
    g.validate()
    return g


def _projection(name: str, base: str, x: str, w: str, y: str, n: int, k: int, fmt, rows: int) -> Launch:
    """A GEMM (`base` "gemm", on `rows` rows) or GEMV launch `y = x · w^T` on the weight `w`
    [n, k], with the op and tiling of the format `fmt(w)` holds it in."""
    f = fmt(w)
    if base == "gemm":
        params = presets.gemm_tiling(rows, n, k) if f == "bf16" else presets.gemm_q4nx_tiling(rows, n, k)
    else:
        params = _gemv(n, k, f)
    return _launch(name, matmul_op(base, f), [x, w], [y], **params)


def rms_gemms_rope(cfg: LlamaConfig, seq: int, quant: str = "bf16", wide=()) -> KernelGroup:
    h, q, kv, d = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    I, S, M, O = Role.INPUT, Role.STATIC, Role.INTERMEDIATE, Role.OUTPUT
    fmt = _formats(quant, wide)
    slots = [
        _slot("x", (seq, h), I), _slot("rope_lut", (seq, d), I),
        _slot("attn_norm", (h,), S), _weight("wq", (q, h), fmt("wq")), _weight("wk", (kv, h), fmt("wk")),
        _weight("wv", (kv, h), fmt("wv")),
        _slot("normed", (seq, h), M), _slot("q_raw", (seq, q), M), _slot("k_raw", (seq, kv), M),
        _slot("q", (seq, q), O), _slot("k", (seq, kv), O), _slot("v", (seq, kv), O),
    ]
    launches = [
        _launch("rmsnorm", "rmsnorm", ["x", "attn_norm"], ["normed"], rows=seq, dim=h, eps=cfg.rms_norm_eps,
                **presets.elementwise_tiling(seq, h)),
        _projection("q_gemm", "gemm", "normed", "wq", "q_raw", q, h, fmt, seq),
        _projection("k_gemm", "gemm", "normed", "wk", "k_raw", kv, h, fmt, seq),
        _projection("v_gemm", "gemm", "normed", "wv", "v", kv, h, fmt, seq),
        _launch("rope_q", "rope", ["q_raw", "rope_lut"], ["q"], rows=seq, heads=cfg.num_attention_heads,
                head_dim=d, herd=presets.ROPE_HERD_PREFILL),
        _launch("rope_k", "rope", ["k_raw", "rope_lut"], ["k"], rows=seq, heads=cfg.num_key_value_heads,
                head_dim=d, herd=presets.ROPE_HERD_PREFILL),
    ]
    return _group("rms_gemms_rope", seq, slots, launches, quant=quant)


def flash_attn(cfg: LlamaConfig, seq: int, ctx: int | None = None) -> KernelGroup:
    """Causal GQA attention of a chunk of `seq` queries over `ctx` cached positions.

    K/V come from the head-major KV cache ([kv_heads, ctx, head_dim]), and `q_start` is the
    chunk's first absolute position: query i sees keys 0..q_start+i. A fresh prompt is
    q_start = 0 with ctx = seq; a later chunk or chat turn reads the earlier positions too.
    """
    ctx = ctx or seq
    if ctx < seq:
        raise ValueError(f"attention context {ctx} is shorter than its chunk {seq}")
    I, O = Role.INPUT, Role.OUTPUT
    kvh, d = cfg.num_key_value_heads, cfg.head_dim
    slots = [
        _slot("q", (seq, cfg.q_dim), I),
        _slot("k_cache", (kvh, ctx, d), I, cache_positions=True),
        _slot("v_cache", (kvh, ctx, d), I, cache_positions=True),
        _slot("q_start", (1,), I, "i32"),
        _slot("attn", (seq, cfg.q_dim), O),
    ]
    launches = [
        _launch("flash_attn", "flash_attn", ["q", "k_cache", "v_cache", "q_start"], ["attn"], seq=seq, ctx=ctx,
                q_heads=cfg.num_attention_heads, kv_heads=kvh, head_dim=d, causal=True,
                **presets.attention_tiling(seq, d)),
    ]
    return _group("flash_attn", seq, slots, launches, ctx)


def _ffn_tail(cfg: LlamaConfig, rows: int, base: str, fmt) -> tuple[list[Slot], list[Launch]]:
    """O projection, residual, RMSNorm, SwiGLU MLP, residual: shared by o_ffn and o_gemv_ffn."""
    h, q, f = cfg.hidden_size, cfg.q_dim, cfg.intermediate_size
    I, S, M, O = Role.INPUT, Role.STATIC, Role.INTERMEDIATE, Role.OUTPUT
    shp = (lambda n: (rows, n)) if base == "gemm" else (lambda n: (n,))
    slots = [
        _slot("attn", shp(q), I), _slot("x_res", shp(h), I),
        _weight("wo", (h, q), fmt("wo")), _slot("ffn_norm", (h,), S),
        _weight("w_gate", (f, h), fmt("w_gate")), _weight("w_up", (f, h), fmt("w_up")),
        _weight("w_down", (h, f), fmt("w_down")),
        _slot("o", shp(h), M), _slot("h1", shp(h), M), _slot("normed", shp(h), M),
        _slot("gate", shp(f), M), _slot("up", shp(f), M), _slot("act", shp(f), M), _slot("down", shp(h), M),
        _slot("out", shp(h), O),
    ]
    launches = [
        _projection("o_proj", base, "attn", "wo", "o", h, q, fmt, rows),
        _launch("add_attn", "add", ["x_res", "o"], ["h1"], n=rows * h, **presets.elementwise_tiling(rows, h)),
        _launch("rmsnorm", "rmsnorm", ["h1", "ffn_norm"], ["normed"], rows=rows, dim=h, eps=cfg.rms_norm_eps,
                **presets.elementwise_tiling(rows, h)),
        _projection("gate_proj", base, "normed", "w_gate", "gate", f, h, fmt, rows),
        _projection("up_proj", base, "normed", "w_up", "up", f, h, fmt, rows),
        _launch("swiglu", "swiglu", ["gate", "up"], ["act"], n=rows * f, **presets.elementwise_tiling(rows, f)),
        _projection("down_proj", base, "act", "w_down", "down", h, f, fmt, rows),
        _launch("add_ffn", "add", ["h1", "down"], ["out"], n=rows * h, **presets.elementwise_tiling(rows, h)),
    ]
    return slots, launches


def o_ffn(cfg: LlamaConfig, seq: int, quant: str = "bf16", wide=()) -> KernelGroup:
    slots, launches = _ffn_tail(cfg, seq, "gemm", _formats(quant, wide))
    return _group("o_ffn", seq, slots, launches, quant=quant)


def rms_gemv_rope(cfg: LlamaConfig, quant: str = "bf16", wide=()) -> KernelGroup:
    h, q, kv, d = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    I, S, M, O = Role.INPUT, Role.STATIC, Role.INTERMEDIATE, Role.OUTPUT
    fmt = _formats(quant, wide)
    slots = [
        _slot("x", (h,), I), _slot("rope_lut", (d,), I),
        _slot("attn_norm", (h,), S), _weight("wq", (q, h), fmt("wq")), _weight("wk", (kv, h), fmt("wk")),
        _weight("wv", (kv, h), fmt("wv")),
        _slot("normed", (h,), M), _slot("q_raw", (q,), M), _slot("k_raw", (kv,), M),
        _slot("q", (q,), O), _slot("k", (kv,), O), _slot("v", (kv,), O),
    ]
    launches = [
        _launch("rmsnorm", "rmsnorm", ["x", "attn_norm"], ["normed"], rows=1, dim=h, eps=cfg.rms_norm_eps,
                **presets.elementwise_tiling(1, h)),
        _projection("q_gemv", "gemv", "normed", "wq", "q_raw", q, h, fmt, 1),
        _projection("k_gemv", "gemv", "normed", "wk", "k_raw", kv, h, fmt, 1),
        _projection("v_gemv", "gemv", "normed", "wv", "v", kv, h, fmt, 1),
        _launch("rope_q", "rope", ["q_raw", "rope_lut"], ["q"], rows=1, heads=cfg.num_attention_heads,
                head_dim=d, herd=presets.ROPE_HERD_DECODE),
        _launch("rope_k", "rope", ["k_raw", "rope_lut"], ["k"], rows=1, heads=cfg.num_key_value_heads,
                head_dim=d, herd=presets.ROPE_HERD_DECODE),
    ]
    return _group("rms_gemv_rope", 1, slots, launches, quant=quant)


def o_gemv_ffn(cfg: LlamaConfig, quant: str = "bf16", wide=()) -> KernelGroup:
    slots, launches = _ffn_tail(cfg, 1, "gemv", _formats(quant, wide))
    return _group("o_gemv_ffn", 1, slots, launches, quant=quant)


def lm_head_rows(cfg: LlamaConfig, quant: str = "bf16") -> int:
    """Rows per vocab partition; the last partition is zero-padded when the vocab does not divide.
    Quantized partitions are whole row-blocks of their format, as many as the GEMV's cores
    share evenly (`backend_presets.gemv_q4nx_rows`)."""
    rows = -(-cfg.vocab_size // LM_HEAD_PARTITIONS)
    return rows if quant == "bf16" else presets.gemv_q4nx_rows(rows)


def lm_head_gemv(cfg: LlamaConfig, quant: str = "bf16") -> KernelGroup:
    h, p = cfg.hidden_size, lm_head_rows(cfg, quant)
    slots = [_slot("x", (h,), Role.INPUT)]
    slots += [_weight(f"w_p{i}", (p, h), quant) for i in range(LM_HEAD_PARTITIONS)]
    slots += [_slot(f"logits_p{i}", (p,), Role.OUTPUT) for i in range(LM_HEAD_PARTITIONS)]
    launches = [
        _launch(f"gemv_p{i}", matmul_op("gemv", quant), ["x", f"w_p{i}"], [f"logits_p{i}"], **_gemv(p, h, quant))
        for i in range(LM_HEAD_PARTITIONS)
    ]
    return _group("lm_head_gemv", 1, slots, launches, quant=quant)


def build_group(kind: str, cfg: LlamaConfig, seq_len: int = 1, ctx_len: int | None = None,
                quant: str = "bf16", wide=()) -> KernelGroup:
    """The declaration of one group; attention has no weights, so it is the same in every format.

    `wide`: the layer weights a quantized model holds in bf16 in the layer this group runs
    (`LlamaWeights.wide`); a kind keeps those of them it reads, so a layer's prefill and decode
    groups agree on each weight's format and share its BO. The LM head is one, not per layer."""
    if kind == "flash_attn":
        return flash_attn(cfg, seq_len, ctx_len)
    if kind == "lm_head_gemv":
        return lm_head_gemv(cfg, quant)
    wide = frozenset(wide) & KIND_WEIGHTS[kind]
    builders = {"rms_gemms_rope": rms_gemms_rope, "o_ffn": o_ffn}
    if kind in builders:
        return builders[kind](cfg, seq_len, quant, wide)
    return {"rms_gemv_rope": rms_gemv_rope, "o_gemv_ffn": o_gemv_ffn}[kind](cfg, quant, wide)


def all_groups(cfg: LlamaConfig, buckets: tuple[int, ...], quant: str = "bf16",
               wide_sets=(frozenset(),)) -> list[KernelGroup]:
    """Every group a session can call: the prefill kinds once per bucket, decode and LM head
    once, and a kind with weights once more for each set of weights `wide_sets` holds in bf16
    (those of a model's layers, `LlamaWeights.wide_sets`; one empty set for a uniform model)."""
    out: dict[str, KernelGroup] = {}
    for wide in wide_sets:
        for g in [build_group(k, cfg, s, quant=quant, wide=wide) for s in buckets for k in PREFILL_KINDS] + \
                 [build_group(k, cfg, quant=quant, wide=wide) for k in DECODE_KINDS + ("lm_head_gemv",)]:
            out.setdefault(g.name, g)
    return list(out.values())


def prefill_buckets(cfg: LlamaConfig, max_seq: int | None = None) -> tuple[int, ...]:
    """Compiled prefill lengths: the presets up to the context limit."""
    limit = min(max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
    b = tuple(s for s in presets.PREFILL_BUCKETS if s <= limit)
    return b or (presets.PREFILL_BUCKETS[0],)


def context_bucket(positions: int, smallest: int, max_context: int) -> int:
    """Attention context compiled for a chunk ending at `positions`: doubling from `smallest`, capped."""
    c = smallest
    while c < positions:
        c *= 2
    return min(c, max_context) if positions <= max_context else c
