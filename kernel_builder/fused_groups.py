"""The resident-KV designs' declarations: a whole decode token as one group, and the prefill
attention that appends a chunk's K/V to the same device-resident cache.

`fused_decode` is one call a token: every layer's RMSNorm, Q/K/V GEMVs, RoPE, the KV append at
the token's position, attention over the cache, O projection, residual, RMSNorm, SwiGLU MLP and
residual, then the final RMSNorm and the LM head's partitions. The KV cache is `Role.STATE`:
each layer's K and V buffers [kv_heads, capacity, head_dim] live on the device, the prefill's
`resident_flash_attn` groups append to them and this group appends and reads; the host never
copies them. The same names as the per-layer groups (`layer_slot`) let the KernelCache give a
layer's weights and cache one buffer in every group that uses them.

How the live length reaches the hardware, in two parts:
- the *window*: a group is compiled for the first `window` positions of the cache, and the host
  runs, for each token, the group of the smallest window of the staircase (`decode_windows`)
  that holds its position. A window fixes the DMA transfers (buffer descriptors are built
  into the instruction stream, so their counts are compile-time): each KV head's K and V
  stream the window's chunks of `chunk` positions, chunk c to split c % splits of the head's
  cores. Every window is compiled over the same buffers [kv_heads, capacity, head_dim], so a
  token that crosses into the next window moves nothing: the weights and the cache are the
  ones every window's call uses.
- the *position*: the i32 input `pos`, which the cores read (a scalar the host writes each
  token). They compute only the live chunks, 0..pos, and mask the positions past `pos` in the
  last one, so compute follows the live context exactly and bytes follow it to within the
  staircase's step (at most 1.5). The window of the whole capacity is upstream's form (its
  fused decode reads its whole compiled window each token), which the cost model's
  validation prices against upstream's published figures.
"""
from __future__ import annotations

from kernel_builder import backend_presets as presets
from kernel_builder.groups import (LM_HEAD_PARTITIONS, _formats, _group, _launch, _projection, _slot, _weight,
                                   lm_head_rows, matmul_op, _gemv)
from llama_base.config import LlamaConfig
from llama_base.group_contract import FUSED_KIND, KernelGroup, Launch, Role, Slot, layer_slot

# The slots of each layer's weights, in the order a layer uses them.
LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
FINAL_NORM_SLOT = "final_norm"


# The smallest window of the staircase, in positions (a window is at least one chunk a split).
SMALLEST_WINDOW = 256


def decode_windows(capacity: int, smallest: int = SMALLEST_WINDOW) -> tuple[int, ...]:
    """The staircase of windows over a cache of `capacity` positions: from `smallest`, each
    power of two and the point halfway up to the next (w, 1.5 w, 2 w, ...), the last the
    capacity itself. A token reads at most 1.5 times its live positions (1.33 times on the
    steps from 1.5 w), where doubling alone would read up to twice them; each step is one more
    module to compile."""
    out, w = [], smallest
    while w < capacity:
        out += [x for x in (w, w * 3 // 2) if x < capacity]
        w *= 2
    return tuple(out) + (capacity,)


def window_for(positions: int, capacity: int) -> int:
    """The window a call that reads `positions` positions (0..positions-1) runs in."""
    for w in decode_windows(capacity):
        if positions <= w:
            return w
    raise IndexError(f"{positions} positions do not fit a cache of {capacity}")


def cache_capacity(cfg: LlamaConfig, max_context: int, largest_bucket: int) -> int:
    """Positions of each layer's resident K/V buffers: the context, plus room for a last prefill
    chunk's padding rows (appended past the real ones, never attended, overwritten by the next
    token), rounded up to whole decode chunks and prefill tiles."""
    need = max_context + largest_bucket - 1
    step = presets.resident_cache_multiple(cfg.head_dim)
    return -(-need // step) * step


def _cache_slots(cfg: LlamaConfig, capacity: int, name=lambda n: n) -> list[Slot]:
    shape = (cfg.num_key_value_heads, capacity, cfg.head_dim)
    return [_slot(name("k_cache"), shape, Role.STATE), _slot(name("v_cache"), shape, Role.STATE)]


def resident_flash_attn(cfg: LlamaConfig, seq: int, capacity: int, window: int | None = None) -> KernelGroup:
    """A prefill chunk's attention on the resident cache: its `seq` K/V rows appended at
    `q_start`, then causal GQA of its queries over positions 0..q_start + row (`flash_attn`'s
    launch over the first `window` positions, the chunk's padded end among them)."""
    window = window or capacity
    if not seq <= window <= capacity:
        raise ValueError(f"a window of {window} positions for a chunk of {seq} in a cache of {capacity}")
    I, O = Role.INPUT, Role.OUTPUT
    kvh, d, kv = cfg.num_key_value_heads, cfg.head_dim, cfg.kv_dim
    slots = [_slot("q", (seq, cfg.q_dim), I), _slot("k", (seq, kv), I), _slot("v", (seq, kv), I),
             _slot("q_start", (1,), I, "i32"), *_cache_slots(cfg, capacity), _slot("attn", (seq, cfg.q_dim), O)]
    launches = [
        _launch("kv_append", "kv_append", ["k", "v", "q_start"], ["k_cache", "v_cache"], rows=seq, ctx=capacity,
                kv_heads=kvh, head_dim=d),
        _launch("flash_attn", "flash_attn", ["q", "k_cache", "v_cache", "q_start"], ["attn"], seq=seq, ctx=capacity,
                window=window, q_heads=cfg.num_attention_heads, kv_heads=kvh, head_dim=d, causal=True,
                **presets.attention_tiling(seq, d)),
    ]
    return _group("flash_attn", seq, slots, launches, window)


def _decode_attention(cfg: LlamaConfig, capacity: int, name, window: int) -> tuple[list[Slot], list[Launch]]:
    """Split-K attention of one token's query heads over the resident cache: each KV head's
    `splits` cores stream their chunks with an online softmax into partial sums, and a merge
    launch combines a head's splits into its query heads' rows."""
    kvh, d = cfg.num_key_value_heads, cfg.head_dim
    group = cfg.num_attention_heads // kvh
    t = presets.decode_attention_tiling(cfg.num_attention_heads, kvh, d, capacity)
    M = Role.INTERMEDIATE
    slots = [_slot(name("attn_acc"), (kvh, t["splits"], group, d), M, "f32"),
             _slot(name("attn_stats"), (kvh, t["splits"], group, 2), M, "f32")]
    launches = [
        _launch(name("attn"), "decode_attn", [name("q"), name("k_cache"), name("v_cache"), "pos"],
                [name("attn_acc"), name("attn_stats")], ctx=capacity, q_heads=cfg.num_attention_heads, kv_heads=kvh,
                head_dim=d, window=window, **t),
        _launch(name("attn_merge"), "attn_merge", [name("attn_acc"), name("attn_stats")], [name("attn")],
                q_heads=cfg.num_attention_heads, kv_heads=kvh, head_dim=d, splits=t["splits"],
                herd=presets.attention_merge_herd(kvh)),
    ]
    return slots, launches


def _layer(cfg: LlamaConfig, layer: int, capacity: int, fmt, x: str, out: str,
           window: int) -> tuple[list[Slot], list[Launch]]:
    """One decoder layer of a token, reading its residual row from `x` and leaving it in `out`."""
    h, q, kv, d, f = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim, cfg.intermediate_size
    S, M = Role.STATIC, Role.INTERMEDIATE
    n = lambda s: layer_slot(layer, s)      # noqa: E731
    w = lambda s, shape: _weight(n(s), shape, fmt(n(s)))    # noqa: E731
    slots = [_slot(n("attn_norm"), (h,), S), w("wq", (q, h)), w("wk", (kv, h)), w("wv", (kv, h)),
             w("wo", (h, q)), _slot(n("ffn_norm"), (h,), S), w("w_gate", (f, h)), w("w_up", (f, h)),
             w("w_down", (h, f)), *_cache_slots(cfg, capacity, n)]
    for name, width in (("normed", h), ("q_raw", q), ("k_raw", kv), ("q", q), ("k", kv), ("v", kv), ("attn", q),
                        ("o", h), ("h1", h), ("normed2", h), ("gate", f), ("up", f), ("act", f), ("down", h)):
        slots.append(_slot(n(name), (width,), M))
    eps, tile = cfg.rms_norm_eps, presets.elementwise_tiling
    attn_slots, attn_launches = _decode_attention(cfg, capacity, n, window)
    slots += attn_slots
    launches = [
        _launch(n("rmsnorm"), "rmsnorm", [x, n("attn_norm")], [n("normed")], rows=1, dim=h, eps=eps, **tile(1, h)),
        _projection(n("q_gemv"), "gemv", n("normed"), n("wq"), n("q_raw"), q, h, fmt, 1),
        _projection(n("k_gemv"), "gemv", n("normed"), n("wk"), n("k_raw"), kv, h, fmt, 1),
        _projection(n("v_gemv"), "gemv", n("normed"), n("wv"), n("v"), kv, h, fmt, 1),
        _launch(n("rope_q"), "rope", [n("q_raw"), "rope_lut"], [n("q")], rows=1, heads=cfg.num_attention_heads,
                head_dim=d, herd=presets.ROPE_HERD_DECODE),
        _launch(n("rope_k"), "rope", [n("k_raw"), "rope_lut"], [n("k")], rows=1, heads=cfg.num_key_value_heads,
                head_dim=d, herd=presets.ROPE_HERD_DECODE),
        _launch(n("kv_append"), "kv_append", [n("k"), n("v"), "pos"], [n("k_cache"), n("v_cache")], rows=1,
                ctx=capacity, kv_heads=cfg.num_key_value_heads, head_dim=d),
        *attn_launches,
        _projection(n("o_proj"), "gemv", n("attn"), n("wo"), n("o"), h, q, fmt, 1),
        _launch(n("add_attn"), "add", [x, n("o")], [n("h1")], n=h, **tile(1, h)),
        _launch(n("rmsnorm2"), "rmsnorm", [n("h1"), n("ffn_norm")], [n("normed2")], rows=1, dim=h, eps=eps,
                **tile(1, h)),
        _projection(n("gate_proj"), "gemv", n("normed2"), n("w_gate"), n("gate"), f, h, fmt, 1),
        _projection(n("up_proj"), "gemv", n("normed2"), n("w_up"), n("up"), f, h, fmt, 1),
        _launch(n("swiglu"), "swiglu", [n("gate"), n("up")], [n("act")], n=f, **tile(1, f)),
        _projection(n("down_proj"), "gemv", n("act"), n("w_down"), n("down"), h, f, fmt, 1),
        _launch(n("add_ffn"), "add", [n("h1"), n("down")], [out], n=h, **tile(1, h)),
    ]
    return slots, launches


def fused_decode(cfg: LlamaConfig, capacity: int, quant: str = "bf16", layer_wide=None,
                 window: int | None = None) -> KernelGroup:
    """A whole decode token as one group (see the module's docstring), for positions below
    `window` (the whole capacity when None). `layer_wide`: each layer's weights held in bf16
    in a quantized model (`LlamaWeights.wide`), none when None."""
    window = window or capacity
    if window > capacity or window % presets.decode_attention_tiling(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, capacity)["chunk"]:
        raise ValueError(f"a window of {window} positions is not whole chunks of a {capacity}-position cache")
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    layer_wide = list(layer_wide) if layer_wide is not None else [frozenset()] * layers
    wide = frozenset(layer_slot(i, w) for i, ws in enumerate(layer_wide) for w in ws)
    fmt = _formats(quant, wide)
    I, S, M, O = Role.INPUT, Role.STATIC, Role.INTERMEDIATE, Role.OUTPUT
    # The residual row alternates between two buffers: a layer reads one and writes the other.
    residual = ("res_a", "res_b")
    slots = [_slot("x", (h,), I), _slot("rope_lut", (cfg.head_dim,), I), _slot("pos", (1,), I, "i32")]
    slots += [_slot(r, (h,), M) for r in residual[:min(layers, 2)]]
    launches: list[Launch] = []
    x = "x"
    for layer in range(layers):
        out = residual[layer % 2]
        s, l = _layer(cfg, layer, capacity, fmt, x, out, window)
        slots += s
        launches += l
        x = out
    p = lm_head_rows(cfg, quant)
    slots += [_slot(FINAL_NORM_SLOT, (h,), S), _slot("normed", (h,), O)]
    slots += [_weight(f"w_p{i}", (p, h), quant) for i in range(LM_HEAD_PARTITIONS)]
    slots += [_slot(f"logits_p{i}", (p,), O) for i in range(LM_HEAD_PARTITIONS)]
    launches.append(_launch("final_norm", "rmsnorm", [x, FINAL_NORM_SLOT], ["normed"], rows=1, dim=h,
                            eps=cfg.rms_norm_eps, **presets.elementwise_tiling(1, h)))
    launches += [_launch(f"gemv_p{i}", matmul_op("gemv", quant), ["normed", f"w_p{i}"], [f"logits_p{i}"],
                         **_gemv(p, h, quant)) for i in range(LM_HEAD_PARTITIONS)]
    return _group(FUSED_KIND, 1, slots, launches, window, quant)


def resident_groups(cfg: LlamaConfig, buckets: tuple[int, ...], max_context: int, quant: str = "bf16",
                    layer_wide=None) -> list[KernelGroup]:
    """The groups a fused-decode session of `max_context` positions can call beside the
    prefill's projections: each bucket's resident attention in every window that holds it,
    and the fused token in every window (sessions compile each on first use)."""
    capacity = cache_capacity(cfg, max_context, buckets[-1])
    windows = decode_windows(capacity)
    attn = [resident_flash_attn(cfg, s, capacity, w) for s in buckets for w in windows if w >= s]
    return attn + [fused_decode(cfg, capacity, quant, layer_wide, w) for w in windows]
