"""One token's GQA attention over the device-resident KV cache: split-K partial sums
(`decode_attn`) and their merge (`attn_merge`), through the attention tile primitives.

`decode_attn` params: `ctx` (the cache's positions), `window` (the positions this build can
attend to, whole chunks, at most `ctx`), `q_heads`, `kv_heads`, `head_dim`, `chunk` (positions
a core streams at a time), `splits` (cores per KV head), `herd` (cols, rows). Slots: q
[q_heads·d], k_cache and v_cache [kv_heads, ctx, d] (head-major), pos [1] i32 (the token's
position: it attends to positions 0..pos), acc [kv_heads, splits, group, d] f32 and stats
[kv_heads, splits, group, 2] f32 (running max, sum), group = q_heads / kv_heads.

Work items are (KV head, split) pairs, item = head·splits + split, dealt to the cores by
their linear index x·rows + y: with the presets' herd, core (x, y) is KV head x's split y
when a column holds one head; several heads to a column, or fewer items than cores, deal the
same way, each item to exactly one core. Split s owns chunks c = s, s + splits, ... of the
window (a loop from s to window / chunk in steps of `splits`); per chunk it moves K and V
[chunk, d] from cache[h, c·chunk], and computes only a live chunk: scores of the group's
query rows, the mask (only in the chunk holding `pos`; every row is the token at `pos`, so
the primitives' row step is 0), the online softmax and p·v. A split with no live chunk
leaves m = fill, l = 0, acc = 0, which the merge weighs zero.

How the live length reaches the hardware: each core DMAs `pos` into its L1, loads it and
computes the live chunk count n = ceil((pos + 1) / chunk) = (pos + chunk) / chunk, against
which every chunk's compute is guarded (`c < n`) and the chunk holding `pos` masked. The
transfers are the window's, fixed when the module is built: on the NPU the shim side of a
DMA is a buffer descriptor in the instruction stream the host issues, so its count is a
build-time fact, and a runtime that wants bytes to follow the length runs a smaller window's
build (`fused_groups.decode_windows`). The numbers do not depend on the window.

`attn_merge` params: `q_heads`, `kv_heads`, `head_dim`, `splits`, `herd`. One core per KV
head (round-robin when fewer) loads its head's acc and stats and writes its group's rows of
attn [q_heads·d] bf16 through the `merge` primitive.
"""
from __future__ import annotations

from typing import Sequence

from kernel_builder import externs
from kernel_builder.backend_presets import L1_BUDGET, decode_attention_l1_bytes
from llama_base.group_contract import Launch, Slot
from kernel_builder.mlir.common import core_index, deal_items, kernel, module, single_herd
from kernel_builder.mlir.emit import L1, Index


def build(launch: Launch, slots: Sequence[Slot]) -> str:
    k = kernel(launch, slots, 4, 2)
    ctx, hq, hkv, d = k.p("ctx"), k.p("q_heads"), k.p("kv_heads"), k.p("head_dim")
    chunk, splits, window = k.p("chunk"), k.p("splits"), k.p("window")
    hx, hy = k.herd()
    cores = hx * hy
    k.require(hq % hkv == 0, f"{hq} query heads do not group over {hkv} key/value heads")
    g = hq // hkv
    shapes = tuple(s.shape for s in k.slots)
    want = ((hq * d,), (hkv, ctx, d), (hkv, ctx, d), (1,), (hkv, splits, g, d), (hkv, splits, g, 2))
    k.require(shapes == want, f"slot shapes {shapes} do not match ctx {ctx}, heads {hq}/{hkv}, dim {d}, "
                              f"{splits} splits")
    k.require(k.slots[3].dtype == "i32", "pos must be an i32 scalar")
    k.require(k.slots[4].dtype == k.slots[5].dtype == "f32", "the partial sums and stats are f32")
    k.require(splits >= 1 and window % chunk == 0 and 0 < window <= ctx,
              f"a window of {window} positions is not whole {chunk}-position chunks of a {ctx}-position cache")
    k.require(decode_attention_l1_bytes(g, chunk, d) <= L1_BUDGET, f"{g} rows over {chunk}x{d} chunks do not fit L1")
    chunks = window // chunk
    init, qk, mask, softmax, pv = externs.decode_attention(d, g, chunk)

    with module(k) as (b, args), single_herd(b, k, args) as h:
        q, kc, vc, pos_in, acc_out, stats_out = h.args
        core = core_index(b, h, (hx, hy))
        pos_l1 = b.alloc([1], "i32", L1, "pos_l1")
        b.dma(pos_l1, None, pos_in, None)
        pos_i32 = b.load(pos_l1, [0], "pos_i32")
        pos = b.to_index(pos_i32)
        live = b.div(b.add(pos, chunk), chunk)           # ceil((pos + 1) / chunk) chunks hold 0..pos
        q1 = b.alloc([g, d], "bf16", L1, "q_l1")
        k1 = b.alloc([chunk, d], "bf16", L1, "k_l1")
        v1 = b.alloc([chunk, d], "bf16", L1, "v_l1")
        s1 = b.alloc([g, chunk], "f32", L1, "s_l1")
        p1 = b.alloc([g, chunk], "bf16", L1, "p_l1")
        m1 = b.alloc([g], "f32", L1, "max_l1")
        l1 = b.alloc([g], "f32", L1, "sum_l1")
        c1 = b.alloc([g], "f32", L1, "corr_l1")
        acc = b.alloc([g, d], "f32", L1, "acc_l1")

        def kv_chunk(cache, buf, head: Index, row: Index) -> None:
            b.dma(buf, None, cache, ([head, row, 0], [1, chunk, d], [ctx * d, d, 1]))

        def scores(row: Index) -> None:
            b.call(qk, q1, k1, s1)
            with b.if_(b.cmp("ugt", b.add(row, chunk - 1), pos)):     # the chunk holding pos
                b.call(mask, s1, pos_i32, b.to_i32(row))
            b.call(softmax, s1, m1, l1, p1, c1)

        def item(i: Index) -> None:
            head, split = b.div(i, splits), b.rem(i, splits)
            b.dma(q1, None, q, ([b.mul(head, g * d)], [g * d], [1]))
            b.call(init, m1, l1, acc)
            with b.loop(split, chunks, splits, "chunk") as c:
                row = b.mul(c, chunk)
                kv_chunk(kc, k1, head, row)
                kv_chunk(vc, v1, head, row)
                with b.if_(b.cmp("ult", c, live)):
                    scores(row)
                    b.call(pv, p1, v1, c1, acc)
            out = [head, split, 0, 0]
            b.dma(acc_out, (out, [1, 1, g, d], [splits * g * d, g * d, d, 1]), acc, None)
            stat = lambda col: ([head, split, 0, col], [1, 1, g, 1], [splits * g * 2, g * 2, 2, 1])  # noqa: E731
            b.dma(stats_out, stat(0), m1, None)
            b.dma(stats_out, stat(1), l1, None)

        deal_items(b, cores, hkv * splits, core, item)
        b.dealloc(pos_l1, q1, k1, v1, s1, p1, m1, l1, c1, acc)
    return b.text()


def build_merge(launch: Launch, slots: Sequence[Slot]) -> str:
    k = kernel(launch, slots, 2, 1)
    hq, hkv, d, splits = k.p("q_heads"), k.p("kv_heads"), k.p("head_dim"), k.p("splits")
    hx, hy = k.herd()
    k.require(hq % hkv == 0, f"{hq} query heads do not group over {hkv} key/value heads")
    g = hq // hkv
    shapes = tuple(s.shape for s in k.slots)
    k.require(shapes == ((hkv, splits, g, d), (hkv, splits, g, 2), (hq * d,)),
              f"slot shapes {shapes} do not match heads {hq}/{hkv}, dim {d}, {splits} splits")
    merge = externs.attention_merge(d, g, splits)

    with module(k) as (b, args), single_herd(b, k, args) as h:
        acc_in, stats_in, out = h.args
        core = core_index(b, h, (hx, hy))
        a1 = b.alloc([splits, g, d], "f32", L1, "acc_l1")
        s1 = b.alloc([splits, g, 2], "f32", L1, "stats_l1")
        o1 = b.alloc([g, d], "bf16", L1, "o_l1")

        def item(head: Index) -> None:
            b.dma(a1, None, acc_in, ([head, 0, 0, 0], [1, splits, g, d], [splits * g * d, g * d, d, 1]))
            b.dma(s1, None, stats_in, ([head, 0, 0, 0], [1, splits, g, 2], [splits * g * 2, g * 2, 2, 1]))
            b.call(merge, a1, s1, o1)
            b.dma(out, ([b.mul(head, g * d)], [g * d], [1]), o1, None)

        deal_items(b, hx * hy, hkv, core, item)
        b.dealloc(a1, s1, o1)
    return b.text()
