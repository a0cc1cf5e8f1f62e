"""Attention at an offset: a chunk's queries see the cached positions before it, and only those."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from kernel_builder.groups import build_group
from verify import reference as ref
from llama_runtime.engine.device_model import DeviceModel
from llama_runtime.engine.prefill import prefill
from npu_runtime.cache import KernelCache
from npu_runtime.sim.device import SimDevice


@pytest.mark.usefixtures("native_isa")   # every ISA class this CPU runs
def test_offset_chunk_matches_reference(tiny_config, tmp_path):
    """A 60-row chunk after 100 cached positions, to the flash bound of `reference`; the stale
    positions past it are large enough that one leaking in breaks the bound."""
    cfg = tiny_config
    seq, ctx, start, n = 128, 256, 100, 60
    g = build_group("flash_attn", cfg, seq, ctx)
    assert g.name == f"flash_attn_s{seq}_c{ctx}"
    kc = KernelCache(SimDevice(), tmp_path)
    kc.compile_and_cache(g)
    kc.preload(g.name, "L0", {})
    torch.manual_seed(0)
    kvh, d = cfg.num_key_value_heads, cfg.head_dim
    k = torch.randn(kvh, ctx, d).to(torch.bfloat16)
    v = torch.randn(kvh, ctx, d).to(torch.bfloat16)
    k[:, start + n:] = 300.0          # stale positions past the chunk: huge if the mask leaked them
    v[:, start + n:] = 300.0
    q = torch.randn(n, cfg.q_dim).to(torch.bfloat16)
    out = kc.load_and_run(g.name, {"q": q, "k_cache": k, "v_cache": v,
                                   "q_start": torch.tensor([start], dtype=torch.int32)}, "L0", rows=n)["attn"]
    tok = lambda t: t[:, : start + n].transpose(0, 1).reshape(start + n, kvh * d)  # noqa: E731
    args = (q, tok(k), tok(v), cfg.num_attention_heads, kvh)
    ref.assert_within_ulps(out, ref.flash_attention(*args, q_start=start), ref.FLASH_ULPS, ref.FLASH_FRACTION,
                           floor=ref.attention_floor(*args, q_start=start))


def test_a_context_call_writes_only_the_written_positions(tiny_config, tmp_path):
    """`context` hands the cache slots over as their written positions only: the buffer's later
    positions keep what an earlier call left there (here huge values), and the real rows come
    out bit for bit as from a call given the whole context with those positions zero."""
    cfg = tiny_config
    seq, ctx, start, n = 128, 256, 100, 60
    end = start + n
    g = build_group("flash_attn", cfg, seq, ctx)
    kc = KernelCache(SimDevice(), tmp_path)
    kc.compile_and_cache(g)
    kc.preload(g.name, "L0", {})
    torch.manual_seed(1)
    kvh, d = cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(n, cfg.q_dim).to(torch.bfloat16)
    q_start = torch.tensor([start], dtype=torch.int32)
    stale = torch.full((kvh, ctx, d), 300.0, dtype=torch.bfloat16)
    kc.load_and_run(g.name, {"q": q, "k_cache": stale, "v_cache": stale, "q_start": q_start}, "L0", rows=n)
    k = torch.zeros(kvh, ctx, d, dtype=torch.bfloat16)
    v = torch.zeros(kvh, ctx, d, dtype=torch.bfloat16)
    k[:, :end], v[:, :end] = torch.randn(kvh, end, d), torch.randn(kvh, end, d)
    part = kc.load_and_run(g.name, {"q": q, "k_cache": k[:, :end], "v_cache": v[:, :end], "q_start": q_start},
                           "L0", rows=n, context=end)["attn"].clone()
    bo = kc._bo_set(g.name, "L0").bos[g.slots.index(g.slot("k_cache"))]
    left = bo.read().view(torch.bfloat16).view(kvh, ctx, d)
    assert torch.equal(left[:, :end], k[:, :end]) and bool((left[:, end:] == 300.0).all())
    whole = kc.load_and_run(g.name, {"q": q, "k_cache": k, "v_cache": v, "q_start": q_start}, "L0", rows=n)["attn"]
    assert torch.equal(part, whole)
    with pytest.raises(ValueError, match="context"):
        kc.load_and_run(g.name, {"q": q, "k_cache": k, "v_cache": v, "q_start": q_start}, "L0", rows=n,
                        context=ctx + 1)


PAGE = 4096
PAGEMAP = Path("/proc/self/pagemap")


def _mapped_pages(t: torch.Tensor) -> list[bool]:
    """Whether each page of `t`'s storage is mapped (bit 63, present, or 62, swapped), as Linux
    reports it to any process (the page frame numbers need privileges, those bits do not)."""
    first, end = t.data_ptr() // PAGE, (t.data_ptr() + t.numel() * t.element_size() + PAGE - 1) // PAGE
    with PAGEMAP.open("rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"<{end - first}Q", f.read((end - first) * 8))
    return [bool(e >> 62 & 3) for e in entries]


@pytest.mark.skipif(not PAGEMAP.exists(), reason="Linux's /proc/self/pagemap")
def test_a_prefill_leaves_the_cache_past_its_prompt_unmapped(tiny_weights, tmp_path):
    """A short prompt in a long bucket reads the cache only where it wrote: a read of the rest
    would map the kernel's zero page there, and each later decode write into such a page
    flushes every core's TLB (a 5 ms decode step one in 32 on a 2-core VM)."""
    model = DeviceModel(KernelCache(SimDevice(), tmp_path), tiny_weights, 1024, buckets=(256,))
    n, d = 20, model.config.head_dim
    per_page = PAGE // (d * model.kv.k.element_size())
    assert model.kv.k[0, 0].numel() * model.kv.k.element_size() % PAGE == 0 and n <= per_page < 256
    prefill(model, list(range(3, 3 + n)))
    for cache in (model.kv.k, model.kv.v):
        for layer in range(cache.shape[0]):
            for head in range(cache.shape[1]):
                assert _mapped_pages(cache[layer, head]) == [True] + [False] * (cache.shape[2] // per_page - 1)
