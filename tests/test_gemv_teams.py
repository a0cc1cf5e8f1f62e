"""Decode's kernels under every team size. A GEMV batch: each thread reads a contiguous share
of the batch and then helps with the others' (`stream_split.h`), so where a share ends, and
whether a job's blocks are read by one thread or two, depends on the team. Whatever the team,
every output row must be written, and to the same bits, since each block's sums run in one
order. The host attention: how a long context is cut into segments depends on the shape alone.
"""
from __future__ import annotations

import os

import pytest
import torch

from cpu_kernels import native_cpu
from llama_runtime.engine.kv_cache import KVCache, decode_attention_cpu
from seeded import gemv_jobs, rand_bf16, run_gemvs, team

pytestmark = [pytest.mark.skipif(native_cpu._library() is None, reason="no native library: the GEMVs are torch's"),
              pytest.mark.usefixtures("native_isa")]

# Unlike jobs: one block only, K from 64 to 8192 (so shares end inside jobs of different block
# sizes), and a job as large as the rest together.
SHAPES = [(32, 64), (96, 8192), (32, 2048), (608, 256), (1024, 2048)]
TEAMS = (1, 3, 5)


@pytest.mark.parametrize("fmt", ["q4nx", "bf16"])
def test_every_team_writes_every_row_to_the_same_bits(fmt):
    jobs, rows = gemv_jobs(fmt, SHAPES), [n for n, _ in SHAPES]
    want = run_gemvs(fmt, jobs, rows)
    for i, y in enumerate(want):
        assert not y.isnan().any(), f"job {i}: rows left unwritten"
        assert torch.equal(run_gemvs(fmt, [jobs[i]], [rows[i]])[0], y), f"job {i} alone differs"
    for threads in TEAMS:
        with team(threads):
            got = run_gemvs(fmt, jobs, rows)
        assert len(os.listdir("/proc/self/task")) >= threads    # the team did grow: its threads stay
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"{threads} threads: job {i} {SHAPES[i]} differs"


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (28, 1, 128), (32, 8, 64)])
def test_the_decode_attention_has_the_same_bits_on_every_team(heads, kv_heads, head_dim):
    """Long contexts: the positions are cut into segments whose sums are merged afterwards
    (`attention_bf16_cpu.cc`), more of them where the KV heads are few, and merging is another
    order of summing. So the cut must follow the shape alone: at each of these positions every
    team gives the same bits."""
    positions = (1030, 1800, 2600, 3500)
    cache = KVCache(1, kv_heads, positions[-1] + 1, head_dim)
    k = rand_bf16(positions[-1] + 1, kv_heads * head_dim, seed=1)
    cache.write(0, 0, k, rand_bf16(positions[-1] + 1, kv_heads * head_dim, seed=2))
    q = rand_bf16(heads * head_dim, seed=3, scale=2.0)
    want = [decode_attention_cpu(q, cache, 0, pos, heads).clone() for pos in positions]
    for threads in TEAMS:
        with team(threads):
            for pos, w in zip(positions, want):
                got = decode_attention_cpu(q, cache, 0, pos, heads)
                assert torch.equal(got, w), f"{threads} threads, {pos + 1} positions"
