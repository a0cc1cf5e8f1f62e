"""The decode GEMVs' prefetch distance, tuned while they run (`stream_ahead.h`): the tuner must
find the fastest rung of its ladder from the one it starts at, follow the host when the fastest
rung changes, stay where it is when its neighbours are slower, and the distance must never
change a result. Its decisions are driven here by given times (`stream_ahead_replay`), so the
tests do not depend on this machine's memory."""
from __future__ import annotations

import pytest
import torch

from cpu_kernels import native_cpu
from cpu_kernels.weight_tiles import Q4nxPacking
from llama_runtime import quantize
from llama_runtime.profile_report import stream_ahead_line
from seeded import rand_bf16

pytestmark = [pytest.mark.skipif(native_cpu._library() is None, reason="no native library: the GEMVs are torch's")]

MB = 1 << 20
# One 1B-shape decode token's GEMV batches, by weight bytes: Q/K/V, O, gate + up, down per
# layer, then the LM head.
TOKEN = [4 * MB, 2.6 * MB, 21 * MB, 10.5 * MB] * 16 + [164 * MB]
START = 1   # the rung the tuner starts at (kAheadStart)


def _replay(phases: list[list[float]], tokens: int, noise: float, seed: int = 0) -> torch.Tensor:
    """The rung of every call over `tokens` tokens per phase, where a call at rung r takes its
    bytes at 60 GB/s times phase[r], with lognormal noise of `noise`: [phases, tokens, calls]."""
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.tensor(TOKEN * tokens * len(phases), dtype=torch.int64)
    factor = torch.tensor(phases, dtype=torch.float64).repeat_interleave(tokens * len(TOKEN), dim=0)
    ns = nbytes.to(torch.float64)[:, None] / 60.0 * factor
    ns = ns * torch.exp(noise * torch.randn(ns.shape, generator=g, dtype=torch.float64))
    return native_cpu.stream_ahead_replay(nbytes, ns).view(len(phases), tokens, len(TOKEN))


def _share(arms: torch.Tensor, rung: int) -> float:
    return float((arms == rung).double().mean())


@pytest.mark.parametrize("isa", native_cpu.supported_isas())
def test_the_tuner_finds_the_fastest_rung_and_follows_the_host_back(isa):
    with native_cpu.use_isa(isa):
        assert len(native_cpu.stream_ahead_ladder()) == 4
        # The host's two states as measured: 10 KiB 9 % faster, then 5 KiB 3 % faster.
        arms = _replay([[1.02, 1.0, 0.91, 0.95], [1.03, 1.0, 1.03, 1.06]], tokens=40, noise=0.03)
    fast, slow = arms
    assert _share(fast[:2], START) > 0.8                # it starts where it was told to
    assert _share(fast[20:], 2) > 0.8                   # and settles on the faster rung
    assert _share(slow[20:], START) > 0.8               # then goes back when the host does
    explored = fast[20:] != 2
    assert 0.05 < float(explored.double().mean()) < 0.2   # about one call in eight tries a neighbour
    assert set(fast[20:][explored].tolist()) <= {1, 3}  # and only its neighbours


@pytest.mark.parametrize("isa", native_cpu.supported_isas())
def test_the_tuner_climbs_to_the_end_of_its_ladder_and_holds_against_slower_neighbours(isa):
    with native_cpu.use_isa(isa):
        far, = _replay([[1.2, 1.1, 1.04, 1.0]], tokens=40, noise=0.03)
        near, = _replay([[1.0, 1.0, 1.04, 1.08]], tokens=40, noise=0.03, seed=1)
    assert _share(far[20:], 3) > 0.8                    # two moves up
    assert set(far[20:][far[20:] != 3].tolist()) == {2}
    # 2.5 KiB as fast as 5 is no reason to move, and 10 KiB is slower: it stays near the start.
    assert _share(near[10:], 2) + _share(near[10:], 3) < 0.1


@pytest.mark.parametrize("fmt", ["q4nx", "bf16"])
def test_the_distance_never_changes_a_result(native_isa, fmt):
    n, k = 256, 2048
    w, x = rand_bf16(n, k, seed=3), rand_bf16(k, seed=4)
    empty = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)
    dev = Q4nxPacking(n, k).pack(quantize.quantize(w), empty) if fmt == "q4nx" else native_cpu.pack_weight(w, empty)
    batch = native_cpu.gemv_q4nx_batch_call if fmt == "q4nx" else native_cpu.gemv_batch_call
    outs = []
    for ahead in [*native_cpu.stream_ahead_ladder(), 64, 1 << 20]:
        y = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        with native_cpu.pinned_stream_ahead(ahead):
            assert native_cpu.stream_ahead()[fmt] == ahead
            batch([(dev, x, y)])()
        outs.append(y)
    assert not outs[0].isnan().any()
    assert all(torch.equal(outs[0], y) for y in outs[1:])


def test_the_environment_pins_the_distance_or_says_what_it_takes(monkeypatch):
    isa = native_cpu.supported_isas()[0]
    monkeypatch.setenv(native_cpu.ENV_AHEAD, "8192")
    with native_cpu.use_isa(isa):
        assert native_cpu.stream_ahead() == {"q4nx": 8192, "bf16": 8192}
        assert "q4nx 8 KiB ahead" in stream_ahead_line() and "pinned by" in stream_ahead_line()
    monkeypatch.setenv(native_cpu.ENV_AHEAD, "auto")
    with native_cpu.use_isa(isa):
        assert native_cpu.stream_ahead() == {"q4nx": 5120, "bf16": 5120}
        assert "tuned while decoding over 2.5, 5, 10, 20 KiB" in stream_ahead_line()
    for bad in ("-1", "5k", "0"):
        monkeypatch.setenv(native_cpu.ENV_AHEAD, bad)
        with pytest.raises(native_cpu.IsaError, match=native_cpu.ENV_AHEAD):
            with native_cpu.use_isa(isa):
                pass
