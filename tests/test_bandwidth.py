"""The bench's bandwidth probe: the decode bound's denominator, so every way it may read must
compute its GEMV right, and a stream must keep the way that reads fastest."""
from __future__ import annotations

import pytest

import bench.bandwidth as bandwidth
from bench.bandwidth import NUMPY, WAYS, Stream, buildable_isas, native_isa, ways_of

_BUILDS = buildable_isas()


@pytest.mark.parametrize("isa", [*_BUILDS, "none"])
def test_every_way_of_every_build_computes_the_gemv_over_every_row(isa):
    """`sample` checks each row's sum; a pass that skipped a line or a row's tail fails it."""
    native = None if isa == "none" else isa
    labels = ways_of(native)
    assert len(labels) == (len(WAYS) if native else 1)
    for label in labels:
        stream = Stream(3 << 20, ways=(label,), isa=isa)
        assert stream.way == label and stream.method.startswith(label)
        assert stream.sample(1).bytes_per_s > 0


def test_a_sample_refuses_a_pass_that_left_a_row_wrong():
    stream = Stream(1 << 20)
    stream.sample(1)
    stream.y[7] = 0
    stream._pass = lambda starts, counts: None          # a pass that wrote nothing
    with pytest.raises(RuntimeError, match="wrong result"):
        stream.sample(1)


def test_a_stream_chooses_among_every_way_and_names_its_choice():
    stream = Stream(1 << 20)
    assert stream.way in ways_of(native_isa()) and stream.method.startswith(stream.way)
    if stream.way != NUMPY:          # numpy's GEMV is the only way where no native pass builds
        assert f"fastest of {len(WAYS)} ways" in stream.method


def test_the_fastest_way_is_kept_by_its_best_pass():
    """A way is judged by its best pass: "noisy" loses its first pass to an interruption and
    still wins on its second, and "steady" never beats it. A clock the runs advance stands in
    for time, so the test measures nothing."""
    now = [0.0]
    costs = {"steady": [3.0, 3.0], "noisy": [9.0, 2.0], "slow": [5.0, 5.0]}
    passes = {label: iter(c) for label, c in costs.items()}

    def run(label):
        return lambda: now.__setitem__(0, now[0] + next(passes[label]))

    runs = {label: run(label) for label in costs}
    assert bandwidth._fastest(runs, 2, clock=lambda: now[0]) == "noisy"
    passes = {label: iter(c) for label, c in costs.items()}
    assert bandwidth._fastest(runs, 1, clock=lambda: now[0]) == "steady"   # one pass: noisy's bad one


def test_ways_that_are_not_on_this_machine_are_refused_in_one_line():
    with pytest.raises(ValueError, match="no bandwidth GEMV among"):
        Stream(1 << 20, ways=("native AVX-1024 f32 GEMV, no prefetch",))


@pytest.mark.skipif(not _BUILDS, reason="no AVX2 or AVX-512 here")
def test_an_unknown_hint_is_an_error_not_a_pass_without_prefetch():
    lib = bandwidth._native_gemv(bandwidth._ISAS[_BUILDS[-1]][1])
    if lib is None:
        pytest.skip("no C++ compiler")
    assert lib.gemv_f32_stream(None, None, None, None, None, 0, 0, 1, 0) == -1


@pytest.mark.parametrize("isa", _BUILDS)
def test_each_build_holds_a_prefetch_of_each_hint(isa, disassemble):
    """A prefetch changes no result, so a compiler that dropped one would go unseen by the
    sums; decode's GEMVs once lost theirs that way (tests/test_stream_ahead.py)."""
    from cpu_kernels.native_build import build_shared

    path = build_shared(bandwidth._SRC, bandwidth._COMMON_FLAGS + bandwidth._ISAS[isa][1])
    if path is None:
        pytest.skip("no C++ compiler")
    asm = disassemble(path)
    for op in ("prefetchnta", "prefetcht1", "prefetcht0"):
        assert op in asm, f"the {isa} bandwidth GEMV lost its {op}"


@pytest.mark.parametrize("isa", [*_BUILDS, "none"])
def test_the_pass_cut_into_calls_reads_every_call_s_rows_and_starts_again_at_the_matrix_s_end(isa):
    """`sample_calls` checks the sums of every row a call read. Six calls of 1.25 MiB over a
    3 MiB matrix: two fit, the third starts again at row 0, and so on."""
    stream = Stream(3 << 20, isa=isa)
    calls = stream.sample_calls([5 << 18] * 6, 1)
    assert calls["calls"] == 6 and calls["call_bytes"] == 6 * (5 << 18) and calls["passes"] == 1
    assert calls["ratio"] == pytest.approx(calls["calls_bytes_per_s"] / calls["whole_bytes_per_s"])
    assert calls["method"] == stream.method


def test_a_cut_pass_that_left_a_call_s_row_wrong_is_refused():
    """Two calls of 512 KiB over a 1 MiB matrix (256 rows): row 200 is the second call's."""
    stream = Stream(1 << 20)

    def one_row_short(starts, counts):
        stream.y.fill(bandwidth._ROW_FLOATS)
        if len(starts) > 1:                 # the cut pass; the whole pass (one call) is right
            stream.y[200] = 0
    stream._pass = one_row_short
    with pytest.raises(RuntimeError, match="wrong result"):
        stream.sample_calls([1 << 19, 1 << 19], 1)


def test_a_call_larger_than_the_matrix_is_refused_in_one_line():
    with pytest.raises(ValueError, match="does not fit"):
        Stream(1 << 20).sample_calls([2 << 20], 1)


@pytest.mark.parametrize("quant", ["bf16", "q4nx"])
def test_a_decode_step_s_calls_are_the_device_s_batches_of_the_declared_weights(quant):
    """Llama-3.2-1B: Q/K/V, O, gate and up, down a layer as the simulated device batches them,
    then the head's partitions in one call; together every declared weight of the step once."""
    from bench.bound import decode_call_bytes
    from kernel_builder import groups
    from llama_base import group_contract
    from llama_base.config import LlamaConfig

    cfg = LlamaConfig()
    calls = decode_call_bytes(cfg, quant)
    assert len(calls) == 4 * cfg.num_hidden_layers + 1
    size = {s.name: s.nbytes for kind in group_contract.DECODE_KINDS for s in groups.build_group(kind, cfg, 1, quant=quant).slots}
    assert calls[:4] == [size["wq"] + size["wk"] + size["wv"], size["wo"], size["w_gate"] + size["w_up"], size["w_down"]]
    head = groups.build_group("lm_head_gemv", cfg, 1, quant=quant)
    assert calls[-1] == sum(s.nbytes for s in head.slots if s.name.startswith("w_p"))
    assert calls[4:8] == calls[:4] and sum(calls) == cfg.num_hidden_layers * sum(calls[:4]) + calls[-1]
