"""Causal GQA flash attention of a prefill chunk over the KV cache, through the attention tile kernels.

Params: `seq` (queries), `ctx` (cached positions), `window` (optional: the first positions of
the cache the queries may see, all `ctx` when absent; a resident cache's build for shorter
contexts), `q_heads`, `kv_heads`, `head_dim`, `causal`, `tile_q` = `tile_kv`, `herd`. Slots: q [seq, q_heads·d] (heads side by side),
k_cache and v_cache [kv_heads, ctx, d] (head-major), q_start [1] i32 (absolute position of
query row 0), out [seq, q_heads·d]. Every (head, tile) block is then one strided DMA.

Work items are (query head, query tile) pairs dealt round-robin to the herd's cores. Query
row i sits at position q_start + i and sees keys 0..q_start + i, so an item visits the
key/value tiles up to the one holding its last query's position, and only tiles reaching
past its first query's position need the mask (positions are absolute, so the same code
serves a fresh prompt, q_start = 0, and a later chunk or chat turn). Query head h reads
key/value head h / (q_heads / kv_heads). The online softmax keeps a running max, sum and
f32 accumulator per query row in L1, so a whole row of scores never exists at once.
This is its own module (see `backend_presets.group_options`).
"""
from __future__ import annotations

from typing import Sequence

from kernel_builder import externs
from kernel_builder.backend_presets import L1_BUDGET, attention_l1_bytes
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import core_index, kernel, module, single_herd
from kernel_builder.mlir.emit import L1, Index


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    k = kernel(launch, slots, 4, 1)
    seq, ctx, hq, hkv, d = k.p("seq"), k.p("ctx"), k.p("q_heads"), k.p("kv_heads"), k.p("head_dim")
    t, causal = k.p("tile_q"), bool(k.p("causal"))
    hx, hy = k.herd()
    cores = hx * hy
    qw = hq * d
    k.require(k.p("tile_kv") == t, "the tile kernels take one tile size for queries and keys")
    shapes = tuple(s.shape for s in k.slots)
    k.require(shapes == ((seq, qw), (hkv, ctx, d), (hkv, ctx, d), (1,), (seq, qw)),
              f"slot shapes {shapes} do not match seq {seq}, ctx {ctx}, heads {hq}/{hkv}, dim {d}")
    k.require(k.slots[3].dtype == "i32", "q_start must be an i32 scalar")
    k.require(hq % hkv == 0, f"{hq} query heads do not group over {hkv} key/value heads")
    window = k.launch.param_dict.get("window", ctx)
    k.require(seq % t == 0 and ctx % t == 0 and window % t == 0, f"tile {t} does not divide seq {seq}, ctx {ctx} "
                                                                  f"and window {window}")
    k.require(seq <= window <= ctx, f"a window of {window} positions for {seq} queries in a {ctx}-position cache")
    k.require(attention_l1_bytes(t, d) <= L1_BUDGET, f"tile {t}x{d} does not fit L1")
    q_tiles, kv_tiles = seq // t, window // t
    items = hq * q_tiles
    rounds = -(-items // cores)
    # One herd calls all six: the emitter names their one bundle object on the herd.
    init, qk, mask, softmax, pv, finalize = externs.attention(d, t)

    with module(k) as (b, args), single_herd(b, k, args) as h:
        q, kc, vc, q_start, o = h.args
        core = core_index(b, h, (hx, hy))
        start_l1 = b.alloc([1], "i32", L1, "q_start_l1")
        b.dma(start_l1, None, q_start, None)
        start = b.to_index(b.load(start_l1, [0], "q_start_i32"))
        q1 = b.alloc([t, d], "bf16", L1, "q_l1")
        k1 = b.alloc([t, d], "bf16", L1, "k_l1")
        v1 = b.alloc([t, d], "bf16", L1, "v_l1")
        s1 = b.alloc([t, t], "f32", L1, "s_l1")
        p1 = b.alloc([t, t], "bf16", L1, "p_l1")
        m1 = b.alloc([t], "f32", L1, "max_l1")
        l1 = b.alloc([t], "f32", L1, "sum_l1")
        c1 = b.alloc([t], "f32", L1, "corr_l1")
        acc = b.alloc([t, d], "f32", L1, "acc_l1")
        o1 = b.alloc([t, d], "bf16", L1, "o_l1")

        def kv_tile(cache, buf, head: Index, row: Index) -> None:
            b.dma(buf, None, cache, ([head, row, 0], [1, t, d], [ctx * d, d, 1]))

        def item(i: Index) -> None:
            head, qt = b.div(i, q_tiles), b.rem(i, q_tiles)
            q_row, q_col = b.mul(qt, t), b.mul(head, d)
            kv_head = b.div(head, hq // hkv)
            q_pos = b.add(start, q_row)
            b.dma(q1, None, q, ([q_row, q_col], [t, d], [qw, 1]))
            b.call(init, m1, l1, acc)
            n_kv = b.min(b.add(b.div(b.add(q_pos, t - 1), t), 1), kv_tiles) if causal else kv_tiles
            with b.loop(0, n_kv, 1, "kt") as kt:
                k_row = b.mul(kt, t)
                kv_tile(kc, k1, kv_head, k_row)
                b.call(qk, q1, k1, s1)
                if causal:
                    with b.if_(b.cmp("ugt", b.add(k_row, t - 1), q_pos)):
                        b.call(mask, s1, b.to_i32(q_pos), b.to_i32(k_row))
                b.call(softmax, s1, m1, l1, p1, c1)
                kv_tile(vc, v1, kv_head, k_row)
                b.call(pv, p1, v1, c1, acc)
            b.call(finalize, acc, l1, o1)
            b.dma(o, ([q_row, q_col], [t, d], [qw, 1]), o1, None)

        with b.loop(0, rounds, 1, "round") as rnd:
            i = b.add(b.mul(rnd, cores), core)
            if rounds * cores == items:
                item(i)
            else:
                with b.if_(b.cmp("ult", i, items)):
                    item(i)
        b.dealloc(start_l1, q1, k1, v1, s1, p1, m1, l1, c1, acc, o1)
    return b.text()
