"""`python -m bench.resident_attention`: one token's attention over one layer's KV cache, the
resident design's native decode_attn + attn_merge against the host attention
(`native_cpu.decode_attention`), at a Llama-3.2-1B layer's shape (32 query heads, 8 KV heads,
head dim 64; 4 splits of 64-position chunks) and the lengths asked for.

Both read the same cache, so the two alternate, each timed as the fastest of several rounds:
a VM's memory rate moves from minute to minute, and this compares the kernels, not the
moments. Prints the CPU, the class, the team and the memory's stream rate beside the table.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

from bench.bandwidth import measure_bandwidth
from bench.machine import describe
from cpu_kernels import native_cpu
from kernel_builder.groups import _launch
from npu_runtime.sim import ops

Q_HEADS, KV_HEADS, HEAD_DIM, CHUNK, SPLITS = 32, 8, 64, 64, 4


def _best(fn, reps: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def run(lengths: list[int], rounds: int) -> list[tuple[int, float, float]]:
    """(positions, resident seconds, host seconds) for each length."""
    cap = -(-max(lengths) // CHUNK) * CHUNK
    g = torch.Generator().manual_seed(0)
    k = torch.randn(KV_HEADS, cap, HEAD_DIM, generator=g).bfloat16()
    v = torch.randn(KV_HEADS, cap, HEAD_DIM, generator=g).bfloat16()
    q = (torch.randn(Q_HEADS * HEAD_DIM, generator=g) * 2).bfloat16()
    group = Q_HEADS // KV_HEADS
    views = {"q": q, "k_cache": k, "v_cache": v, "pos": torch.zeros(1, dtype=torch.int32),
             "acc": torch.empty(KV_HEADS, SPLITS, group, HEAD_DIM), "stats": torch.empty(KV_HEADS, SPLITS, group, 2),
             "attn": torch.empty(Q_HEADS * HEAD_DIM, dtype=torch.bfloat16)}
    attn = _launch("attn", "decode_attn", ["q", "k_cache", "v_cache", "pos"], ["acc", "stats"], ctx=cap,
                   q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, chunk=CHUNK, splits=SPLITS)
    merge = _launch("merge", "attn_merge", ["acc", "stats"], ["attn"], q_heads=Q_HEADS, kv_heads=KV_HEADS,
                    head_dim=HEAD_DIM, splits=SPLITS)
    calls = [ops.bind(attn, views), ops.bind(merge, views)]
    if not all(isinstance(c, native_cpu.NativeCall) for c in calls):
        raise SystemExit("the resident kernels did not bind natively (no native library?)")
    out = torch.empty_like(views["attn"])
    rows = []
    for n in lengths:
        views["pos"][0] = n - 1
        reps = max(2, 2 ** 16 // n)
        resident = lambda: [c() for c in calls]     # noqa: E731
        host = lambda: native_cpu.decode_attention(q, k, v, n, out)     # noqa: E731
        t_res, t_host = float("inf"), float("inf")
        for _ in range(rounds):
            t_res = min(t_res, _best(resident, reps, 1))
            t_host = min(t_host, _best(host, reps, 1))
        rows.append((n, t_res, t_host))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.resident_attention", description=__doc__.splitlines()[0])
    ap.add_argument("--positions", default="128,1024,4096,16384,32768", help="comma-separated context lengths")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the OpenMP team's size")
    ap.add_argument("--isa", default=None, help="a native class to run as (native_cpu.use_isa), else the best")
    ap.add_argument("--rounds", type=int, default=40, help="alternations; each kernel's fastest counts")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.positions.split(",") if x.strip()]
    torch.set_num_threads(args.threads)
    with native_cpu.use_isa(args.isa) if args.isa else contextlib.nullcontext():
        machine = describe()
        print(f"CPU: {machine['cpu']}, {machine['core']}; class {native_cpu.isa()}; {torch.get_num_threads()} threads")
        rows = run(lengths, args.rounds)
    print(f"memory: {measure_bandwidth().bytes_per_s / 1e9:.1f} GB/s (the bandwidth probe's fastest pass)")
    print(f"{'positions':>9}  {'decode_attn+merge':>17}  {'host attention':>14}  host / resident")
    for n, t_res, t_host in rows:
        print(f"{n:>9}  {t_res * 1e6:>14.1f} µs  {t_host * 1e6:>11.1f} µs  {t_host / t_res:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
