"""Attention at an offset: a chunk's queries see the cached positions before it, and only those."""
from __future__ import annotations

import pytest
import torch

from kernel_builder.groups import build_group
from llama_runtime import reference as ref
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
