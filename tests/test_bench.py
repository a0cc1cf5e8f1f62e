"""The bench harness: its arithmetic, its measurement protocol, its llama.cpp build settings,
and one quick end-to-end run on the embedded model. Nothing here asserts a speed."""
from __future__ import annotations

import gc
import io
import json
import math
import os
import statistics
import subprocess
import sys
import time
import weakref
from dataclasses import replace

import pytest
from tokenizers import Tokenizer as HFTokenizer

import bench.__main__ as bench_cli
import bench.machine as bench_machine
import bench.run as bench_run
from bench.bandwidth import GIB, Bandwidth, Stream
from bench.bandwidth import summarize as summarize_bandwidth
from bench.bound import decode_bound_tokens_per_s, decode_bytes_per_token, kv_cache_bytes, weight_bytes
from bench.gguf_convert import trim_tokenizer_files
from bench.llamacpp_build import AMX_SWITCHES, cmake_args
from bench.depth import depth_peer, merge_depth_rounds, plot_depths, summarize_depths
from bench.load import loads, summarize_load
from bench.plan import FULL, QUICK, depth_label, only_depth, prompt_ids, split_depths, with_depths, with_types
from bench.protocol import (DECODE_SPLIT, DEPTH, JOB_FILE, PREPARE, PROJECT_ROOT, RESULT_FILE, busy_loops, child_main,
                            measure, measure_depth, serve_turns)
from bench.render import depth_table
from bench.render import model_table as render_model_table
from bench.run import merge_rounds, run_side
from bench.summary import (HF, LLAMACPP, LLAMACPP_BF16, OURS, OURS_BF16, host_share, paired_ratio, ratio,
                           summarize_model, with_calls)
from bench.turns import BANDWIDTH, decode_turns
from llama_base.config import LlamaConfig
from llama_runtime.checkpoints.builtin import ensure_embedded_model, llama_tokenizer_dir
from llama_runtime.engine.kv_cache import KVCache
from llama_runtime.checkpoints.resolve import EMBEDDED
from llama_runtime.text.tokenizer import Tokenizer
from llama_runtime.checkpoints.weights import synthetic_weights
from verify.eval_text import eval_chunks

LLAMA_1B = LlamaConfig()


def test_q4nx_decode_reads_the_q4nx_bytes_of_every_linear_weight_and_the_padded_head():
    # Q4NX: 5 bits a weight (4-bit values + a bf16 scale and min per 32); the head's 128256 rows
    # padded to 128256 (a multiple of 32 already); one bf16 embedding row.
    per_layer = 2048 * 2048 + 2 * (512 * 2048) + 2048 * 2048 + 3 * (8192 * 2048)
    assert decode_bytes_per_token(LLAMA_1B, "q4nx") == (16 * per_layer + 128256 * 2048) * 5 // 8 + 2 * 2048
    assert decode_bytes_per_token(LLAMA_1B, "q4nx") == 772_345_856


def test_decode_bytes_per_token_of_llama_3_2_1b():
    # 16 layers of q, k, v, o, gate, up, down at hidden 2048, 8 KV heads of 64, FFN 8192; the tied
    # 128256 x 2048 head counted once; one 2048-wide embedding row; bf16.
    per_layer = 2048 * 2048 + 2 * (512 * 2048) + 2048 * 2048 + 3 * (8192 * 2048)
    expected = 2 * (16 * per_layer + 128256 * 2048 + 2048)
    assert decode_bytes_per_token(LLAMA_1B) == expected == 2_471_497_728
    assert decode_bound_tokens_per_s(expected, 30e9) == pytest.approx(12.138, abs=1e-3)


def test_an_untied_head_is_read_besides_the_embedding_row():
    untied = LlamaConfig(tie_word_embeddings=False)
    assert decode_bytes_per_token(untied) == decode_bytes_per_token(LLAMA_1B)   # still one head + one row
    assert weight_bytes(untied) - weight_bytes(LLAMA_1B) == 2 * 128256 * 2048


def test_weight_and_kv_bytes_match_the_runtime_s_own_tensors(tiny_config):
    assert weight_bytes(tiny_config) == synthetic_weights(tiny_config).nbytes()
    c = tiny_config
    assert kv_cache_bytes(c, 96) == KVCache(c.num_hidden_layers, c.num_key_value_heads, 96, c.head_dim).nbytes


class _Scripted:
    """Next token = last token + 1; records every call so the protocol's bookkeeping shows."""

    class _R:
        def __init__(self, t):
            self.top1 = t

    def __init__(self):
        self.prefills, self.steps = [], []

    def prefill(self, ids):
        self.prefills.append(len(ids))
        return self._R(ids[-1] + 1)

    def decode_step(self, token, pos):
        self.steps.append((token, pos))
        return self._R(token + 1)


def test_process_age_counts_from_the_start_of_the_process():
    """The bench's load time starts when the child process does: a child that sleeps 0.5 s
    before asking reports at least that, and no more than its whole life seen from outside."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); "
                          "from bench.protocol import process_age_s; print(process_age_s())"],
                         capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - t0
    tick = 1 / os.sysconf("SC_CLK_TCK")               # /proc counts the start in clock ticks
    assert 0.5 <= float(out) <= wall + 2 * tick


def test_protocol_runs_warmups_untimed_and_decodes_after_the_decode_prompt():
    r = _Scripted()
    out = measure(r, {4: [0, 1, 2, 3], 2: [0, 1]}, decode_length=4, n_decode=3, runs=2, warmup=1)
    assert r.prefills == [2, 2, 2, 4, 4, 4]                 # shortest first; 1 warm-up + 2 runs each
    assert {k: len(v) for k, v in out["ttft_s"].items()} == {"2": 2, "4": 2}
    assert len(out["decode_tok_s"]) == 2 and all(v > 0 for v in out["decode_tok_s"])
    assert r.steps[:3] == [(4, 4), (5, 5), (6, 6)]          # greedy tokens fed back at consecutive positions


def test_protocol_times_short_prompts_more_often_and_decodes_after_the_first_run_only():
    r = _Scripted()
    out = measure(r, {4: [0, 1, 2, 3], 9: list(range(9))}, decode_length=4, n_decode=3, runs=1, warmup=1,
                  short_runs=3, short_limit=4)
    assert r.prefills == [4, 4, 4, 4, 9, 9]                 # 1 warm-up + 3 timed (short), 1 + 1 (long)
    assert {k: len(v) for k, v in out["ttft_s"].items()} == {"4": 3, "9": 1}
    assert len(out["decode_tok_s"]) == 1 and len(r.steps) == 2 * 3   # after the warm-up and the first timed run


def test_a_prepare_job_builds_the_runtime_and_times_nothing(tmp_path):
    built = []

    def make_runner(job):
        built.append(job["model"])
        return _Scripted(), {"kernels_compiled": 3}

    job = {"model": "m", "prompts": {"4": [0, 1, 2, 3]}, "decode_length": 4, "n_decode": 3, "runs": 2, "warmup": 1}
    for extra, times in (({PREPARE: True}, False), ({}, True)):
        (tmp_path / JOB_FILE).write_text(json.dumps({**job, **extra}))
        assert child_main(make_runner, [str(tmp_path)]) == 0
        result = json.loads((tmp_path / RESULT_FILE).read_text())
        assert result["info"] == {"kernels_compiled": 3} and result["peak_rss_bytes"] > 0
        assert ("ttft_s" in result) is times and ("decode_tok_s" in result) is times
    assert built == ["m", "m"]

    class Split(_Scripted):
        def decode_split(self, prompt, n):
            return {"steps": n, "prompt": list(prompt)}

    (tmp_path / JOB_FILE).write_text(json.dumps({**job, PREPARE: True}))
    assert child_main(lambda job: (Split(), {}), [str(tmp_path)]) == 0
    result = json.loads((tmp_path / RESULT_FILE).read_text())
    assert result[DECODE_SPLIT] == {"steps": 3, "prompt": [0, 1, 2, 3]} and "decode_tok_s" not in result


def test_the_host_share_caps_the_fraction_of_the_bound():
    """772 MB at 80 GB/s is 9.65 ms; 2 ms outside the device's runs caps decode at 9.65 / 11.65."""
    side = {DECODE_SPLIT: {"steps": 8, "step_s": 0.012, "device_run_s": 0.010}}
    share = host_share(side, 772_000_000, 80e9)
    assert share["host_s"] == pytest.approx(0.002) and share["ceiling"] == pytest.approx(9.65 / 11.65)
    assert host_share({}, 772_000_000, 80e9) is None and host_share(side, 772_000_000, None) is None


def test_the_cut_pass_and_the_host_share_cap_the_fraction_together():
    """Calls read at 90 % of the whole pass: the device's runs take 9.65 / 0.9 ms, plus the
    host's 2 ms. A cut pass that failed, or no host share, is passed on as it is."""
    share = host_share({DECODE_SPLIT: {"steps": 8, "step_s": 0.012, "device_run_s": 0.010}}, 772_000_000, 80e9)
    calls = with_calls({"calls": 65, "ratio": 0.9}, share)
    assert calls["ceiling_with_host"] == pytest.approx(9.65 / (9.65 / 0.9 + 2.0))
    assert with_calls({"error": "too big"}, share) == {"error": "too big"}
    assert with_calls({"calls": 65, "ratio": 0.9}, None) == {"calls": 65, "ratio": 0.9} and with_calls(None, share) is None


def test_turns_decode_bursts_within_the_positions_the_rounds_time():
    """Bursts continue where the last one stopped; one that would pass n_decode positions after
    the prompt prefills it again first, so turns time the same positions as the rounds."""
    r = _Scripted()
    replies = io.StringIO()
    assert serve_turns(r, [0, 1, 2, 3], 3, ["2\n", "1\n", "2\n"], replies) == 3
    assert r.prefills == [4, 4]
    assert [pos for _, pos in r.steps] == [4, 5, 6, 4, 5]
    assert r.steps[:3] == [(4, 4), (5, 5), (6, 6)]          # greedy tokens fed back across bursts
    assert all(float(x) >= 0 for x in replies.getvalue().split())
    with pytest.raises(ValueError, match="1..3"):
        serve_turns(r, [0, 1, 2, 3], 3, ["4\n"], io.StringIO())


def test_decode_ratio_pairs_bursts_of_the_same_turn():
    """A turn where the host was fast for both counts as one ratio, whatever the absolute rates;
    a turn one side missed is left out of the pairs."""
    raw = {OURS: _raw({32: [0.1]}, [9.0, 30.0], 1, decode_turns_tok_s=[10.0, 20.0, None, 12.0]),
           LLAMACPP_BF16: _raw({32: [0.1]}, [11.0, 10.0], 1, decode_turns_tok_s=[8.0, 16.0, 9.0, 12.0]),
           HF: _raw({32: [0.1]}, [5.0], 1)}
    m = summarize_model("1b", LLAMA_1B, False, (32,), 128, raw, None)
    lc = m["ratios"][LLAMACPP_BF16]
    assert lc["decode"] == pytest.approx(1.25)                  # pairs 1.25, 1.25, 1.0
    assert lc["decode_rounds"] == pytest.approx(19.5 / 10.5)    # the rounds' medians, kept beside it
    assert m["runtimes"][OURS]["decode_tok_s"] == 12.0 and m["runtimes"][OURS]["decode_rounds_tok_s"] == 19.5
    assert m["ratios"][HF]["decode"] == pytest.approx(19.5 / 5.0)   # HF had no turns: rounds against rounds
    assert paired_ratio([1.0, None], [None, 2.0]) is None
    table = render_model_table(m)
    assert "| decode, in turns (tokens/s) | 12.00 |" in table and "| decode, in rounds (tokens/s) | 19.50 |" in table


_FLAKY_SIDE = """
from bench.protocol import child_main

class Runner:
    calls = 0
    class R:
        top1 = 1
    def prefill(self, ids):
        return self.R()
    def decode_step(self, token, pos):
        Runner.calls += 1
        if Runner.calls > {ok_steps}:
            raise RuntimeError("device lost")
        return self.R()

raise SystemExit(child_main(lambda job: (Runner(), {{}})))
"""


def test_a_side_that_fails_in_the_turns_is_left_out_and_the_others_go_on(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "steady_side.py").write_text(_FLAKY_SIDE.format(ok_steps=10**6))
    (mods / "flaky_side.py").write_text(_FLAKY_SIDE.format(ok_steps=2 * 2))    # warm-up and one turn of 2 steps
    monkeypatch.setenv("PYTHONPATH", str(mods))
    job = {"prompts": {"4": [0, 1, 2, 3]}, "decode_length": 4, "n_decode": 2}
    sides = [("steady", "steady_side", job, sys.executable), ("flaky", "flaky_side", job, sys.executable),
             ("absent", "no_such_side", job, sys.executable), ("unbuilt", "steady_side", job, str(tmp_path / "nopy"))]
    notes: list[str] = []
    rates = decode_turns("m", sides, 3, 2, tmp_path / "w", bench_run.child_env(), tmp_path, notes, lambda _: None)
    assert set(rates) == {"steady", "flaky"} and len(rates["steady"]) == 3 and None not in rates["steady"]
    assert rates["flaky"][0] > 0 and rates["flaky"][1:] == [None, None]
    assert any("absent left out of the decode turns" in n and "No module named" in n for n in notes)
    assert any("flaky failed in the decode turns: RuntimeError: device lost" in n for n in notes)
    assert any("unbuilt left out of the decode turns: could not start" in n for n in notes)


_SPINNING_SIDE = """
import os, sys, threading, time
from bench.protocol import child_main

LOG = os.environ["TURN_LOG"]
SPIN_S = 0.3

def log(event):
    with open(LOG, "a") as f:
        f.write(f"{sys.argv[1]} {event} {time.time()!r}\\n")

class Runner:
    class R:
        top1 = 1
    def prefill(self, ids):
        return self.R()
    def decode_step(self, token, pos):
        log("step")
        threading.Thread(target=self.spin).start()    # as OpenMP's workers spin on after a region
        return self.R()
    def spin(self):
        end = time.time() + SPIN_S
        while time.time() < end:
            pass
        log("quiet")

raise SystemExit(child_main(lambda job: (Runner(), {})))
"""


def test_a_burst_starts_only_once_the_previous_child_has_stopped_running(tmp_path, monkeypatch):
    """Each child's threads keep running for SPIN_S after every step it answers: no other
    child's step may fall while they do."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "spinning_side.py").write_text(_SPINNING_SIDE)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    monkeypatch.setenv("TURN_LOG", str(tmp_path / "turns.log"))
    job = {"prompts": {"4": [0, 1, 2, 3]}, "decode_length": 4, "n_decode": 2}
    sides = [(name, "spinning_side", job, sys.executable) for name in ("a", "b")]
    rates = decode_turns("m", sides, 2, 1, tmp_path / "w", bench_run.child_env(), tmp_path, [], lambda _: None)
    assert set(rates) == {"a", "b"}
    events = [line.split() for line in (tmp_path / "turns.log").read_text().splitlines()]
    steps = {w: [float(t) for who, e, t in events if who.endswith(f"/{w}/turns") and e == "step"] for w in "ab"}
    quiet = {w: [float(t) for who, e, t in events if who.endswith(f"/{w}/turns") and e == "quiet"] for w in "ab"}
    assert len(steps["a"]) == len(quiet["a"]) == 3            # the warm-up and two turns of one step
    for w, other in (("a", "b"), ("b", "a")):
        for start, end in zip(steps[w], quiet[w]):             # w's threads run from each step until quiet
            assert not any(start < t < end for t in steps[other]), f"{other} stepped while {w} still ran"


def test_a_bandwidth_sample_frees_its_matrix_as_soon_as_it_is_taken():
    """A run takes a sample after every runtime: a matrix left to the cyclic collector would
    hold a GiB each until it ran (15 GiB were seen held by the time of the decode turns)."""
    gc.disable()
    try:
        stream = Stream(1 << 20)
        assert stream.sample(2).bytes_per_s > 0
        alive = weakref.ref(stream)
        del stream
        assert alive() is None
    finally:
        gc.enable()


def test_the_bandwidth_is_sampled_in_every_turn_by_a_child_of_its_own(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "steady_side.py").write_text(_FLAKY_SIDE.format(ok_steps=10**6))
    monkeypatch.setenv("PYTHONPATH", str(mods))
    job = {"prompts": {"4": [0, 1, 2, 3]}, "decode_length": 4, "n_decode": 2}
    rates = decode_turns("m", [("steady", "steady_side", job, sys.executable)], 3, 2, tmp_path / "w",
                         bench_run.child_env(), PROJECT_ROOT, [], lambda _: None, bandwidth_bytes=16 << 20)
    assert set(rates) == {"steady", BANDWIDTH} and len(rates[BANDWIDTH]) == 3
    assert all(1e8 < b < 1e13 for b in rates[BANDWIDTH])      # bytes/s of a real GEMV, not seconds
    notes: list[str] = []             # its matrix counts in the memory the turns need
    assert decode_turns("m", [], 1, 2, tmp_path, {}, tmp_path, notes, lambda _: None, bandwidth_bytes=1 << 60) == {}
    assert "decode turns skipped" in notes[0]


def test_the_bound_is_taken_turn_by_turn_where_the_turns_sampled_the_bandwidth():
    """A burst in a slow turn is held against that turn's bound, not the run's median."""
    per_token = decode_bytes_per_token(LLAMA_1B, "q4nx")
    raw = {OURS: _raw({128: [0.3]}, [40.0], 1, decode_turns_tok_s=[30.0, 60.0, None, 45.0]),
           OURS_BF16: _raw({128: [0.3]}, [20.0], 2, decode_turns_tok_s=[15.0, 30.0, 20.0, 20.0])}
    m = summarize_model("llama1b-shape", LLAMA_1B, False, (128,), 4096, raw, 50e9, "q4nx",
                        turn_bandwidth=[40e9, 80e9, 80e9, None])
    paired = statistics.median([30.0 * per_token / 40e9, 60.0 * per_token / 80e9])
    assert m["bound_fraction_turns"][OURS] == pytest.approx(paired)
    assert m["bound_fraction"][OURS] == pytest.approx(statistics.median([30.0, 60.0, 45.0]) * per_token / 50e9)
    (t,) = [t for t in m["targets"] if "bound" in t["name"]]
    assert t["row"] == "bound_turns" and t["value"] == pytest.approx(paired)
    assert "| decode, % of the bound in the same turn |" in render_model_table(m)
    # no samples in the turns: the run's median bounds
    (t,) = [t for t in summarize_model("llama1b-shape", LLAMA_1B, False, (128,), 4096, raw, 50e9, "q4nx")["targets"]
            if "bound" in t["name"]]
    assert t["row"] == "bound" and t["value"] == pytest.approx(m["bound_fraction"][OURS])


def test_turns_are_skipped_when_the_runtimes_do_not_fit_in_memory_together(tmp_path):
    notes: list[str] = []
    rates = decode_turns("m", [("x", "no_such_side", {}, sys.executable)], 2, 2, tmp_path, {}, tmp_path, notes,
                         lambda _: None, peaks={"x": 1 << 60})
    assert rates == {} and "decode turns skipped" in notes[0] and not (tmp_path / "x").exists()


def test_the_largest_peers_are_left_out_of_the_turns_until_the_rest_fit():
    """An 8B's bf16 runtimes cannot be loaded beside its 4-bit ones: they are left out, ours
    never is, and nothing is left out where everything fits."""
    from bench.turns import MEMORY_HEADROOM, fitting_sides

    gib = 1 << 30
    sides = [(name, "m", {}, "py") for name in (OURS, OURS_BF16, "llama.cpp q4_0", "llama.cpp q4_1")]
    peaks = {OURS: 5 * gib, OURS_BF16: 13 * gib, "llama.cpp q4_0": 5 * gib, "llama.cpp q4_1": 6 * gib}
    notes: list[str] = []
    have = int(17 * gib * MEMORY_HEADROOM)
    kept = fitting_sides("8b", sides, peaks, gib, have, notes)
    assert [s[0] for s in kept] == [OURS, "llama.cpp q4_0", "llama.cpp q4_1"]
    assert OURS_BF16 in notes[0] and "left out of the decode turns" in notes[0]
    assert fitting_sides("8b", sides, peaks, gib, 40 * gib, notes) == sides and len(notes) == 1
    assert fitting_sides("8b", sides, peaks, gib, 10 * gib, notes) == [] and "skipped" in notes[1]


def _raw(ttft: dict[int, list[float]], decode: list[float], peak: int, **extra) -> dict:
    return {"ttft_s": {str(k): v for k, v in ttft.items()}, "decode_tok_s": decode, "peak_rss_bytes": peak, **extra}


def test_summary_ratios_and_targets():
    gib = 1 << 30
    raw = {
        OURS: _raw({128: [0.30, 0.20, 0.25], 2048: [4.0, 4.2, 3.9]}, [10.0, 11.0, 10.5], 3 * gib,
                   info={"kv_cache_bytes": gib // 4}),
        HF: _raw({128: [0.50, 0.40, 0.45], 2048: [3.0, 3.0, 3.0]}, [7.0, 7.0, 7.0], 4 * gib),
        LLAMACPP_BF16: _raw({128: [1.7], 2048: [30.0]}, [8.0], 2 * gib),
    }
    bw = 30e9
    m = summarize_model("1b", LLAMA_1B, False, (128, 2048), 4096, raw, bw)
    assert m["runtimes"][OURS]["ttft_s"][128] == 0.25 and m["runtimes"][OURS]["decode_tok_s"] == 10.5
    assert m["ratios"][HF]["ttft@128"] == pytest.approx(0.25 / 0.45)
    assert m["ratios"][HF]["decode"] == pytest.approx(10.5 / 7.0)
    assert m["ratios"][LLAMACPP_BF16]["decode"] == pytest.approx(10.5 / 8.0)
    assert m["ratios"][LLAMACPP_BF16]["peak_rss"] == pytest.approx(1.5)
    assert m["decode_bound_tok_s"] == pytest.approx(12.1384, abs=1e-4)     # 30 GB/s over 2.471 GB a token
    assert m["kv_cache_bytes"] == gib // 4          # what the runtime reported, not a recomputation
    est = m["npu_estimate"]      # the cost model, calibrated on upstream's published 1.21 s / 12.2 tok/s
    assert est["ttft_s"]["2048"] == pytest.approx(1.21, rel=0.1) and est["decode_tok_s"] == pytest.approx(12.2, rel=0.1)
    assert est["ttft_s"]["128"] < est["ttft_s"]["2048"]
    status = {t["name"]: t["status"] for t in m["targets"]}
    assert status == {
        "TTFT@128 ≤ 0.8× HF": "PASS",                      # 0.56×
        "TTFT@2048 ≤ 1.0× HF": "MISS",                     # 1.33×
        "TTFT@128 ≤ 1.0× llama.cpp bf16": "PASS",          # 0.15×
        "TTFT@2048 ≤ 1.0× llama.cpp bf16": "PASS",         # 0.13×
        "decode ≥ 85% of the bandwidth bound": "PASS",     # 10.5 of 12.14 tokens/s: 86.5 %
        "decode ≥ 1.2× llama.cpp bf16": "PASS",            # 1.31×
        "peak memory ≤ 1.5× (bf16 weights + KV cache)": "PASS",   # 3 GiB of 2.30 + 0.25 GiB: 1.18×
    }
    values = {t["name"]: t["value"] for t in m["targets"]}
    assert values["decode ≥ 85% of the bandwidth bound"] == pytest.approx(0.8650, abs=1e-4)
    assert values["peak memory ≤ 1.5× (bf16 weights + KV cache)"] == pytest.approx(1.1756, abs=1e-4)
    raw[OURS]["decode_tok_s"] = [10.0]                     # 82 % of the bound
    m = summarize_model("1b", LLAMA_1B, False, (128, 2048), 4096, raw, bw)
    assert {t["name"]: t["status"] for t in m["targets"]}["decode ≥ 85% of the bandwidth bound"] == "MISS"


def test_missing_numbers_are_not_applicable_never_a_pass():
    raw = {OURS: _raw({32: [0.1]}, [5.0], 1), HF: {"error": "RuntimeError: boom", "peak_rss_bytes": 1}}
    m = summarize_model(EMBEDDED, LLAMA_1B, True, (32,), 128, raw, None)
    assert m["runtimes"][HF]["error"] == "RuntimeError: boom"
    assert m["ratios"][HF]["decode"] is None and m["decode_bound_tok_s"] is None
    assert [(t["name"], t["status"]) for t in m["targets"]] == [("decode ≥ 1.0× HF", "n/a"),
                                                                ("load ≤ 3 s (warm cache)", "n/a")]
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None


def test_the_bound_uses_the_median_bandwidth_sample():
    samples = [(label, Bandwidth(rate, GIB, "m", 2, [GIB / rate])) for label, rate in
               (("start", 30e9), ("a", 20e9), ("b", 34e9))]
    bw = summarize_bandwidth(samples)
    assert (bw["bytes_per_s"], bw["min_bytes_per_s"], bw["max_bytes_per_s"]) == (30e9, 20e9, 34e9)
    assert [x["after"] for x in bw["samples"]] == ["start", "a", "b"]


def test_runtimes_take_turns_round_by_round_and_their_rounds_merge(monkeypatch, tmp_path):
    """A drifting host must fall on every runtime alike: ours, HF, ours, HF — never ours, ours, HF, HF."""
    folder = ensure_embedded_model()
    order, samples, prepared, notes = [], [], [], []
    chunks = eval_chunks(Tokenizer(folder, LlamaConfig.from_json(folder)), QUICK.perplexity_chunks,
                         QUICK.perplexity_len)

    def fake_side(module, job, workdir, python, log):
        if job.get(PREPARE):
            prepared.append((module, workdir.parent.name))
            return {"info": {"kernels_compiled": 24}, DECODE_SPLIT: {"steps": 2, "step_s": 0.02, "device_run_s": 0.01}}
        order.append((module, workdir.name))
        k = len(order)
        if "perplexity" in job:          # every runtime gets the same chunks, after the timing
            assert job["perplexity"] == chunks
            return {"perplexity": {"nll": [1.0] * QUICK.perplexity_len, "top1": [k] * QUICK.perplexity_len}}
        assert prepared == [("bench.side_ours", OURS)]     # built once before anything is timed
        info = {"round": workdir.name, "kernels_compiled": int(k == 3)}
        return {"ttft_s": {"32": [0.1 * k]}, "decode_tok_s": [float(k)], "peak_rss_bytes": 100 * k,
                "load_s": 1.0 / k, "other_cores": 0.0, "wall_s": 2.0, "info": info}

    def fake_turns(model, sides, turns, steps, workdir, env, cwd, notes, log, peaks, bandwidth_bytes):
        order.append(("turns", [name for name, *_ in sides], turns, steps, peaks))
        assert bandwidth_bytes == QUICK.bandwidth_bytes
        return {OURS: [4.0, 6.0], HF: [2.0, None], BANDWIDTH: [5e10, 6e10]}

    monkeypatch.setattr(bench_run, "run_side", fake_side)
    monkeypatch.setattr(bench_run, "decode_turns", fake_turns)
    _, raw, _, turn_bandwidth = bench_run.bench_model(EMBEDDED, QUICK, "sim", None, tmp_path, notes, samples.append,
                                                      lambda _: None)
    assert order == [("bench.side_ours", "round1"), ("bench.side_hf", "round1"),
                     ("bench.side_ours", "round2"), ("bench.side_hf", "round2"),
                     ("turns", [OURS, HF], QUICK.turns, QUICK.turn_steps, {OURS: 300, HF: 400}),
                     ("bench.side_ours", "one-thread-round1"),      # under load: ours alone (no llama.cpp peer)
                     *[("bench.side_ours", f"ours-{busy}-round1") for busy in loads()],
                     ("bench.side_ours", "ppl"), ("bench.side_hf", "ppl")]
    assert raw[HF]["perplexity"]["top1"] == [8 + len(loads())] * QUICK.perplexity_len
    assert len(samples) == 6                # bandwidth after every child, after the turns, after the load rounds
    assert raw[OURS]["decode_turns_tok_s"] == [4.0, 6.0] and raw[HF]["decode_turns_tok_s"] == [2.0, None]
    assert BANDWIDTH not in raw and turn_bandwidth == [5e10, 6e10]      # the bound of each turn, apart
    ours = raw[OURS]
    assert ours[DECODE_SPLIT]["step_s"] == 0.02 and DECODE_SPLIT not in raw[HF]
    assert ours["ttft_s"] == {"32": [pytest.approx(0.1), pytest.approx(0.3)]} and ours["decode_tok_s"] == [1.0, 3.0]
    assert ours["peak_rss_bytes"] == 300 and ours["wall_s"] == 4.0 and ours["info"]["round"] == "round1"
    # a timed round that still compiled is named: its load and peak carry the compiler
    assert [n for n in notes if "compiled" in n] == [f"{EMBEDDED}: {OURS} compiled 1 kernel groups in round 2: "
                                                     "its load time and peak memory include the MLIR compiler."]

    def failing_prepare(module, job, workdir, python, log):
        return {"error": "RuntimeError: no split\ntraceback"} if job.get(PREPARE) else fake_side(module, job, workdir,
                                                                                                python, log)

    monkeypatch.setattr(bench_run, "run_side", failing_prepare)
    notes.clear()
    _, raw, _, _ = bench_run.bench_model(EMBEDDED, QUICK, "sim", None, tmp_path, notes, samples.append, lambda _: None)
    assert DECODE_SPLIT not in raw[OURS]
    assert f"{EMBEDDED}: {OURS}'s untimed build and decode split failed: RuntimeError: no split" in notes


def test_a_failed_round_is_reported_and_the_others_still_count():
    good = {"ttft_s": {"32": [0.2]}, "decode_tok_s": [5.0], "peak_rss_bytes": 7, "load_s": 3.0}
    merged = merge_rounds([{"error": "killed by SIGKILL", "peak_rss_bytes": 9}, good])
    assert merged["ttft_s"] == {"32": [0.2]} and merged["decode_tok_s"] == [5.0]
    assert merged["error"] == "round 1: killed by SIGKILL" and merged["peak_rss_bytes"] == 9
    assert "ttft_s" not in summarize_model(EMBEDDED, LLAMA_1B, True, (32,), 128,
                                           {OURS: merge_rounds([{"error": "boom"}])}, None)["runtimes"][OURS]


def test_llamacpp_build_turns_amx_and_native_off_and_follows_the_cpu():
    avx512 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd", "avx512vl",
                        "avx512dq", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})
    args = cmake_args(avx512)
    assert "-DGGML_NATIVE=OFF" in args
    assert all(f"-D{s}=OFF" in args for s in AMX_SWITCHES)          # even when the CPU advertises AMX
    assert "-DGGML_AVX512=ON" in args and "-DGGML_AVX512_BF16=ON" in args and "-DGGML_AVX512_VNNI=OFF" in args
    assert "-DGGML_AVX512=OFF" in cmake_args(avx512 - {"avx512vl"})  # needs every AVX-512 subset it compiles for


def test_a_lower_class_run_hides_what_the_class_lacks_from_every_runtime(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: test\nflags\t\t: sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl "
                       "avx512dq avx512bw avx512_bf16 avx_vnni amx_tile\n")
    monkeypatch.setattr(bench_machine, "CPUINFO", cpuinfo)
    flags = bench_machine.cpu_flags("avx2")
    assert "avx2" in flags and not any(f.startswith(("avx512", "amx", "avx_vnni")) for f in flags)
    assert "-DGGML_AVX512=OFF" in cmake_args(flags) and "-DGGML_AVX2=ON" in cmake_args(flags)
    assert "avx512f" in bench_machine.cpu_flags()
    env = bench_machine.CLASS_ENV["avx2"]
    assert env["LLAMA_NPU_ISA"] == "avx2" and bench_machine.describe("avx2")["class_env"] == env
    vnni = bench_machine.cpu_flags("avxvnni")                      # Alder Lake on: AVX-VNNI without AVX-512
    assert "avx_vnni" in vnni and not any(f.startswith(("avx512", "amx")) for f in vnni)
    assert "-DGGML_AVX_VNNI=ON" in cmake_args(vnni) and "-DGGML_AVX_VNNI=OFF" in cmake_args(flags)
    assert bench_machine.CLASS_ENV["avxvnni"]["LLAMA_NPU_ISA"] == "avxvnni"


def test_the_machine_names_its_core_generation_from_family_and_model(monkeypatch, tmp_path):
    # "model name" must not be read as "model", and a VM that names only "AMD EPYC" still says its core.
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
                       "flags\t\t: avx2\n")
    monkeypatch.setattr(bench_machine, "CPUINFO", cpuinfo)
    assert bench_machine.describe()["core"] == "Zen 4 (family 25, model 17)"
    assert bench_machine.core_name("AuthenticAMD", 25, 1) == "Zen 3 (family 25, model 1)"
    assert bench_machine.core_name("AuthenticAMD", 26, 2) == "Zen 5 (family 26, model 2)"
    assert bench_machine.core_name("AuthenticAMD", 26, 0x50) == "Zen 6 (family 26, model 80)"
    assert bench_machine.core_name("AuthenticAMD", 26, 0x3F) == "AuthenticAMD family 26, model 63"   # no range
    assert bench_machine.core_name("GenuineIntel", 6, 143) == "GenuineIntel family 6, model 143"
    cpuinfo.write_text("model name\t: test\n")
    assert bench_machine.describe()["core"] == "unknown core"


def test_tokenizer_trim_drops_ids_past_the_text_vocabulary(tmp_path):
    src = llama_tokenizer_dir()
    changed = trim_tokenizer_files(src, tmp_path, LLAMA_1B.vocab_size)
    assert "tokenizer.json" in changed
    tok = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == LLAMA_1B.vocab_size
    assert tok.token_to_id("<|image|>") is None and tok.token_to_id("<|eot_id|>") == 128009
    if (tmp_path / "tokenizer_config.json").exists():
        decoder = json.loads((tmp_path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
        assert max(map(int, decoder)) < LLAMA_1B.vocab_size
    assert trim_tokenizer_files(ensure_embedded_model(), tmp_path / "x", 49152) == []   # nothing to trim


def test_prompts_have_exactly_the_asked_lengths():
    folder = ensure_embedded_model()
    cfg = LlamaConfig.from_json(folder)
    ids = prompt_ids(folder, cfg, (32, 300))
    assert [len(ids[32]), len(ids[300])] == [32, 300]
    assert ids[300][:32] == ids[32] and max(ids[300]) < cfg.vocab_size


def test_a_crashing_side_becomes_an_error_not_an_exception(tmp_path):
    out = run_side("bench.no_such_side", {}, tmp_path / "w", log=lambda _: None)
    assert "exit status 1" in out["error"] and "No module named" in out["error"]


@pytest.fixture
def reports(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_NPU_REPORTS", str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_quick_bench_on_the_embedded_model_writes_both_reports(reports, capsys):
    rc = bench_cli.main(["--quick", "--models", EMBEDDED, "--skip-llamacpp", "--device", "sim"])
    out = capsys.readouterr().out
    assert rc == 0
    (jpath,) = reports.glob("bench-*.json")
    md = jpath.with_suffix(".md").read_text()
    data = json.loads(jpath.read_text())
    bw = data["bandwidth"]
    assert [x["after"] for x in bw["samples"]] == ["start"] + [f"{EMBEDDED} {side} round {r}" for r in (1, 2)
                                                               for side in (OURS, HF)] + \
        [f"{EMBEDDED} decode turns", f"{EMBEDDED} under load"]
    assert 0 < bw["min_bytes_per_s"] <= bw["bytes_per_s"] <= bw["max_bytes_per_s"] and bw["method"] in md
    assert f"Machine: {data['machine']['cpu']}, {data['machine']['core']}," in md      # which CPU the figures are from
    (m,) = data["models"]
    assert set(m["runtimes"]) == {OURS, HF}
    for s in m["runtimes"].values():
        assert "error" not in s
        assert set(s["ttft_s"]) == {"32"} and s["ttft_s"]["32"] > 0 and len(s["runs"]["ttft_s"]["32"]) == 2
        assert s["decode_tok_s"] > 0 and s["peak_rss_bytes"] > 0 and "other_cores" in s
    ours, hf = m["runtimes"][OURS], m["runtimes"][HF]
    turns = {k: s["runs"]["decode_turns_tok_s"] for k, s in m["runtimes"].items()}
    assert all(len(t) == QUICK.turns and all(r > 0 for r in t) for t in turns.values())
    assert math.isclose(m["ratios"][HF]["decode"], paired_ratio(turns[OURS], turns[HF]))
    assert math.isclose(m["ratios"][HF]["decode_rounds"], ours["decode_rounds_tok_s"] / hf["decode_rounds_tok_s"])
    assert "| decode, in turns (tokens/s) |" in md and "then decode in 2 turns" in md.lower()
    turn_bw = m["turn_bandwidth"]                          # sampled in every turn, beside the bursts
    assert len(turn_bw) == QUICK.turns and all(b > 1e8 for b in turn_bw)
    assert m["bound_fraction_turns"][OURS] > 0 and "| decode, % of the bound in the same turn |" in md
    hs = m["host_share"]                                   # measured by ours' untimed prepare child
    assert hs["steps"] == QUICK.n_decode and 0 < hs["device_run_s"] < hs["step_s"] and 0 < hs["ceiling"] < 1
    assert hs["bandwidth_bytes_per_s"] == statistics.median(turn_bw)
    assert "Our decode step outside the device's runs" in md
    calls = m["call_structure"]          # the bandwidth pass cut into ours' decode calls (simulated device)
    assert calls["calls"] == 4 * data["models"][0]["config"]["layers"] + 1 and calls["ratio"] > 0
    assert 0 < calls["ceiling_with_host"] and f"makes {calls['calls']} GEMV calls on the simulated device" in md
    assert math.isclose(m["decode_bound_tok_s"], data["bandwidth"]["bytes_per_s"] / m["decode_bytes_per_token"])
    assert [t["name"] for t in m["targets"]] == ["decode ≥ 1.0× HF", "load ≤ 3 s (warm cache)"]
    assert all(t["status"] in ("PASS", "MISS") for t in m["targets"])
    assert ours["load_s"] > 0 and "| load: process start to ready (s) |" in md
    assert any("--skip-llamacpp" in n for n in data["notes"])
    assert "| metric | ours | HF transformers | ours/HF transformers | target |" in md
    assert "NPU estimate of the fused decode (cost model, not a measurement)" in md
    assert all(d["tok_s"] > 0 for d in m["npu_estimate"]["depths"])
    assert data["plan"]["decode"] == "auto" and "our decode `auto` → `fused`" in md    # as asked, as chosen
    dep = m["depth"]                     # the quick plan's depth sweep: ours alone, llama.cpp skipped
    assert dep["kept"] == list(QUICK.depths) and dep["skipped"] == {} and dep["peer"] is None
    assert dep["max_context"] == {OURS: QUICK.depths[-1] + QUICK.depth_decode} and dep["decode"] == "fused"
    for d in QUICK.depths:
        s = dep["by_depth"][str(d)]["runtimes"][OURS]
        assert "error" not in s and s["ttft_s"] > 0 and s["decode_tok_s"] > 0 and s["peak_rss_bytes"] > 0
        assert len(s["runs"]["ttft_s"]) == len(s["runs"]["decode_tok_s"]) == QUICK.depth_rounds
    mem = dep["memory"]
    assert mem["deep_positions"] == QUICK.depths[-1] + QUICK.depth_decode and mem["ratio"] > 0
    assert [t["status"] for t in dep["targets"][:-1]] == ["n/a"] * 3          # no llama.cpp: not a pass
    assert dep["targets"][-1]["status"] in ("PASS", "MISS")
    assert "## Decode at depth" in md and f"Figures from {data['machine']['cpu']}, {data['machine']['core']}," in md
    png = jpath.with_name(data["depth_plot"])        # beside the reports, linked from the Markdown
    assert png.name == f"{jpath.stem}-depth.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({png.name})" in md and "| 256 |" in md and "Peak memory at 256:" in md
    ld = m["load"]                       # under load: ours alone here (no llama.cpp), the loops really ran
    assert ld["one_thread_idle"]["decode_tok_s"] > 0 and ld["peer"] is None
    for busy in loads():
        o = ld["by_load"][str(busy)]["runtimes"][OURS]
        assert o["decode_tok_s"] > 0 and o["ttft_s"] > 0 and o["busy_held_cores"] > 0.3 * busy
        assert o["threads"].startswith("threads: ")
    assert [t["status"] for t in ld["targets"]][:3] in (["PASS", "n/a", "n/a"], ["MISS", "n/a", "n/a"])
    assert "## Under load" in md and "| 1 | ours |" in md
    assert str(jpath) in out


def _ppl_raw(nll: float, top1: list[int]) -> dict:
    return {"nll": [nll] * len(top1), "top1": top1, "seconds": 1.0}


def test_q4nx_targets_compare_with_llamacpp_s_fastest_4_bit_type_and_our_bf16():
    """Each llama.cpp target is against whichever 4-bit type did best on that measure: q4_1 for
    TTFT@128, q4_k_m for TTFT@2048 and decode; the bf16 targets against ours on bf16 weights."""
    gib = 1 << 30
    ppl_ours, ppl_q4_1 = _ppl_raw(math.log(20.0), [1, 2, 3, 4]), _ppl_raw(math.log(19.8), [1, 2, 3, 4])
    raw = {
        OURS: _raw({128: [0.6], 2048: [9.0]}, [36.0], int(1.3 * gib), perplexity=ppl_ours),
        OURS_BF16: _raw({128: [0.6], 2048: [9.5]}, [16.0], int(2.8 * gib), perplexity=_ppl_raw(1.0, [1, 2, 3, 5])),
        "llama.cpp q4_0": _raw({128: [0.8], 2048: [12.0]}, [30.0], gib),
        "llama.cpp q4_1": _raw({128: [0.7], 2048: [13.0]}, [28.0], gib, perplexity=ppl_q4_1),
        "llama.cpp q4_k_m": _raw({128: [0.9], 2048: [11.0]}, [33.0], gib),
    }
    m = summarize_model("1b", LLAMA_1B, False, (128, 2048), 4096, raw, 30e9, quant="q4nx")
    assert m["decode_bound_tok_s"] == pytest.approx(38.843, abs=1e-3)      # 30 GB/s over 0.772 GB a token
    got = {t["name"]: (t["status"], t["value"]) for t in m["targets"]}
    assert got == {
        "TTFT@128 ≤ 1.0× llama.cpp's fastest 4-bit": ("PASS", pytest.approx(0.6 / 0.7)),
        "TTFT@2048 ≤ 1.0× llama.cpp's fastest 4-bit": ("PASS", pytest.approx(9.0 / 11.0)),
        "decode ≥ 1.1× llama.cpp's fastest 4-bit": ("MISS", pytest.approx(36.0 / 33.0)),
        "decode ≥ 2.0× ours bf16": ("PASS", pytest.approx(2.25)),
        "decode ≥ 85% of the q4nx bandwidth bound": ("PASS", pytest.approx(0.9268, abs=1e-4)),
        "peak memory ≤ 0.45× ours bf16": ("MISS", pytest.approx(1.3 / 2.8, abs=1e-6)),
        "perplexity ≤ 1.02× llama.cpp q4_1": ("PASS", pytest.approx(20.0 / 19.8)),
    }
    ppl = {k: s.get("perplexity") for k, s in m["runtimes"].items()}
    assert ppl[OURS]["perplexity"] == pytest.approx(20.0) and ppl[OURS]["top1_agreement"] == 0.75
    assert ppl[OURS_BF16]["top1_agreement"] == 1.0 and ppl["llama.cpp q4_0"] is None
    assert m["bound_readers"] == [OURS] and m["perplexity_reference"] == OURS_BF16
    table = render_model_table(m)
    assert "| perplexity | 20.000 | 2.718 | — | 19.800 | — |" in table
    assert "| top-1 agreement with ours bf16 | 75.0% | 100.0% | — | 75.0% | — |" in table
    assert "| decode, % of the q4nx bound |" in table


def test_the_embedded_model_s_q4nx_target_is_its_perplexity_against_llamacpp_q4_1():
    raw = {OURS: _raw({32: [0.1]}, [5.0], 1, perplexity=_ppl_raw(math.log(21.0), [1, 2]), load_s=2.0),
           OURS_BF16: _raw({32: [0.1]}, [5.0], 1, perplexity=_ppl_raw(math.log(20.0), [1, 2])),
           "llama.cpp q4_1": _raw({32: [0.1]}, [5.0], 1, perplexity=_ppl_raw(math.log(20.0), [1, 3]))}
    m = summarize_model(EMBEDDED, LLAMA_1B, True, (32,), 128, raw, None, quant="q4nx")
    assert [(t["name"], t["status"]) for t in m["targets"]] == [("perplexity ≤ 1.02× llama.cpp q4_1", "MISS"),
                                                                ("load ≤ 3 s (warm cache)", "PASS")]
    assert m["runtimes"]["llama.cpp q4_1"]["perplexity"]["top1_agreement"] == 0.5
    del raw["llama.cpp q4_1"]
    m = summarize_model(EMBEDDED, LLAMA_1B, True, (32,), 128, raw, None, quant="q4nx")
    assert m["targets"][0]["status"] == "n/a"                  # no llama.cpp: not a pass


def test_quick_q4nx_bench_scores_perplexity_for_ours_in_both_formats(reports):
    rc = bench_cli.main(["--quick", "--quant", "q4nx", "--models", EMBEDDED, "--skip-llamacpp", "--device", "sim",
                         "--decode", "layers", "--depths", "none"])
    assert rc == 0
    (jpath,) = reports.glob("bench-*.json")
    data = json.loads(jpath.read_text())
    (m,) = data["models"]
    assert data["plan"]["depths"] == [] and "depth" not in m and data["depth_plot"] is None    # --depths none
    assert not list(reports.glob("*.png")) and "Decode at depth" not in jpath.with_suffix(".md").read_text()
    assert {s["info"]["decode"] for s in m["runtimes"].values()} == {"layers"}
    assert data["plan"]["quant"] == "q4nx" and set(m["runtimes"]) == {OURS, OURS_BF16}
    assert m["runtimes"][OURS]["info"]["quant"] == "q4nx" and m["runtimes"][OURS_BF16]["info"]["quant"] == "bf16"
    ppl = {k: s["perplexity"] for k, s in m["runtimes"].items()}
    assert all(p["tokens"] == QUICK.perplexity_len and 1 < p["perplexity"] < 1000 for p in ppl.values())
    assert ppl[OURS_BF16]["top1_agreement"] == 1.0 and 0 < ppl[OURS]["top1_agreement"] <= 1.0
    assert m["decode_bytes_per_token"] < m["weight_bytes"] / 2        # counted at Q4NX's 5 bits
    md = jpath.with_suffix(".md").read_text()
    assert "our weights `q4nx`" in md and "| perplexity |" in md and "| top-1 agreement with ours bf16 |" in md


def test_peak_memory_steps_report_each_steps_peak_and_the_largest_mappings():
    """`bench.peak_memory`'s bookkeeping: a step's peak is at least what it leaves resident and
    at least the run's peak so far, and the mappings name the anonymous memory."""
    from bench.peak_memory import Steps, resident_by_mapping

    lines = []
    steps = Steps(lines.append)
    held = steps.run("hold 32 MiB", lambda: bytearray(32 << 20))
    assert len(held) == 32 << 20
    row = steps.rows[0]
    assert row["step"] == "hold 32 MiB" and row["step_peak"] >= row["rss"] > 0
    assert steps.peak >= row["step_peak"] and len(lines) == 1
    names = [name for name, _ in resident_by_mapping()]
    assert "[anon]" in names or "[heap]" in names


# ---- decode at depth ----------------------------------------------------------------------

def _depth_runs(ttfts: list[float], rates: list[float], peaks: list[int], **info) -> dict:
    return merge_depth_rounds([{"ttft_s": t, "decode_tok_s": r, "peak_rss_bytes": p, "load_s": 1.0,
                                "other_cores": 0.0, "wall_s": 2.0, "info": info}
                               for t, r, p in zip(ttfts, rates, peaks)])


def test_a_depth_child_warms_up_short_then_times_the_whole_prompt_and_the_steps_after_it():
    r = _Scripted()
    out = measure_depth(r, list(range(10)), n_decode=3, warmup_tokens=4, warmup_steps=2)
    assert r.prefills == [4, 10]                                 # the warm-up's short prompt, then the whole one
    assert [pos for _, pos in r.steps] == [4, 5, 10, 11, 12]     # 2 warm-up steps, 3 timed after the prompt
    assert out["ttft_s"] >= 0 and out["decode_tok_s"] > 0


def test_depths_past_a_model_s_limit_are_skipped_with_the_reason():
    embedded = LlamaConfig.from_json(ensure_embedded_model())
    assert embedded.max_position_embeddings == 8192 and LLAMA_1B.max_position_embeddings == 131072
    kept, skipped = split_depths(FULL, embedded, EMBEDDED)
    assert kept == (1024, 4096) and set(skipped) == {8192, 16384, 32768}
    assert skipped[8192] == ("8192 positions and 64 decode steps after them exceed embedded's "
                             "max_position_embeddings of 8192")
    assert split_depths(FULL, LLAMA_1B, "llama1b-shape") == (FULL.depths, {})
    assert split_depths(QUICK, embedded, EMBEDDED) == ((64, 256), {})
    assert [depth_label(d) for d in FULL.depths] == ["1K", "4K", "8K", "16K", "32K"] and depth_label(64) == "64"
    assert with_depths(FULL, (4096, 1024, 4096)).depths == (1024, 4096)
    assert with_depths(FULL, (4096, 32768)).depth_ttft_targets == (32768,)      # 8K is no longer measured
    with pytest.raises(ValueError, match="increasing"):
        replace(FULL, depths=(4096, 1024))
    with pytest.raises(ValueError, match="TTFT target"):
        replace(FULL, depths=(1024,))
    with pytest.raises(ValueError, match="decode 'fast'"):
        replace(FULL, decode="fast")


def test_depth_ratios_memory_and_targets_on_constructed_numbers():
    gib, per_pos = 1 << 30, 32768                     # the 1B shape's KV: 32 KiB a position
    weights = int(1.8 * gib)
    plan = replace(FULL, depths=(1024, 8192, 32768), depth_ttft_targets=(8192, 32768))
    lc = f"{LLAMACPP} bf16"
    # our peak: 0.4 GiB overhead + weights + KV; at 32K 50 MiB more than the KV alone would need
    peak = {d: weights + int(0.4 * gib) + (d + 64) * per_pos for d in plan.depths}
    peak[32768] += 50 << 20
    raw = {"kept": [1024, 8192, 32768], "skipped": {}, "peer": lc, "peer_reason": "the same weights class, bf16",
           "kv_bytes_per_position": per_pos, "max_context": {OURS: 32832, lc: "each depth + its decode steps"},
           "runs": {OURS: {"1024": _depth_runs([0.5, 0.7, 0.6], [22.0, 24.0, 23.0], [peak[1024]] * 3,
                                               resident_bytes={"static": weights}, decode="layers"),
                           "8192": _depth_runs([6.0, 6.2], [18.0, 19.0], [peak[8192]] * 2),
                           "32768": _depth_runs([60.0], [11.0], [peak[32768]])},
                    lc: {"1024": _depth_runs([1.0, 1.2, 1.1], [18.0, 20.0, 19.0], [gib] * 3),
                         "8192": _depth_runs([5.0, 5.0], [17.0, 17.0], [gib] * 2),
                         "32768": {**_depth_runs([], [], []), "error": "round 1: killed by SIGKILL"}}}}
    d = summarize_depths(raw, plan)
    at = d["by_depth"]
    assert at["1024"]["runtimes"][OURS]["ttft_s"] == pytest.approx(0.6)
    assert at["1024"]["runtimes"][lc]["decode_tok_s"] == 19.0
    assert at["1024"]["ratios"] == {"ttft": pytest.approx(0.6 / 1.1), "decode": pytest.approx(23.0 / 19.0)}
    assert at["8192"]["ratios"] == {"ttft": pytest.approx(6.1 / 5.0), "decode": pytest.approx(18.5 / 17.0)}
    assert at["32768"]["ratios"] == {"ttft": None, "decode": None} and "SIGKILL" in at["32768"]["runtimes"][lc]["error"]
    mem = d["memory"]
    assert (mem["short_depth"], mem["deep_depth"], mem["deep_positions"]) == (1024, 32768, 32832)
    assert mem["overhead_bytes"] == int(0.4 * gib) and mem["kv_deep_bytes"] == 32832 * per_pos
    assert mem["ratio"] == pytest.approx(peak[32768] / (weights + int(0.4 * gib) + 32832 * per_pos))
    got = {t["name"]: (t["status"], t["value"]) for t in d["targets"]}
    assert got == {
        "decode @1K ≥ 1.1× llama.cpp bf16": ("PASS", pytest.approx(23.0 / 19.0)),
        "decode @8K ≥ 1.1× llama.cpp bf16": ("MISS", pytest.approx(18.5 / 17.0)),
        "TTFT @8K ≤ 1.0× llama.cpp bf16": ("MISS", pytest.approx(6.1 / 5.0)),
        "decode @32K ≥ 1.1× llama.cpp bf16": ("n/a", None),            # llama.cpp failed there: not a pass
        "TTFT @32K ≤ 1.0× llama.cpp bf16": ("n/a", None),
        "peak memory @32K ≤ 1.2× (weights + KV written + overhead at 1K)": ("PASS", pytest.approx(mem["ratio"])),
    }
    assert d["decode"] == "layers" and d["peer"] == lc
    # one depth only: no shorter context to take the overhead from, so no verdict
    one = summarize_depths({**raw, "kept": [1024]}, replace(plan, depths=(1024,), depth_ttft_targets=()))
    assert "error" in one["memory"] and one["targets"][-1]["status"] == "n/a"
    table = depth_table({"depth": d})
    assert "| 1K | 0.600 | 1.100 | 0.55× | 23.00 | 19.00 | 1.21× |" in table
    assert "TTFT @8K ≤ 1.0× llama.cpp bf16: 1.22× **MISS**" in table


def test_the_depth_peer_is_llamacpp_bf16_or_the_fastest_4_bit_type():
    q4 = FULL.for_quant("q4nx")
    rates = {"llama.cpp q4_0": [30.0], "llama.cpp q4_1": [28.0], "llama.cpp q4_k_m": [33.0]}
    raw = {name: _raw({128: [1.0]}, r, 1) for name, r in rates.items()}
    assert depth_peer(q4, raw)[0] == "llama.cpp q4_k_m" and "fastest" in depth_peer(q4, raw)[1]
    raw["llama.cpp q4_0"]["decode_turns_tok_s"] = [40.0]         # the turns' rate decides where there is one
    assert depth_peer(q4, raw)[0] == "llama.cpp q4_0"
    assert depth_peer(q4, {"llama.cpp q4_1": {"error": "boom"}})[0] == "llama.cpp q4_1"
    assert depth_peer(FULL, {LLAMACPP_BF16: {}, "llama.cpp q8_0": {}})[0] == LLAMACPP_BF16
    assert depth_peer(FULL, {OURS: {}, HF: {}}) == (None, "llama.cpp not measured")
    # A depth-only run ranks nothing: its peer is the one type it converts, named before any run.
    assert only_depth(q4).gguf_types == ("q4_0",) and only_depth(FULL).gguf_types == ("bf16",)
    assert depth_peer(only_depth(q4), {})[0] == "llama.cpp q4_0" and "depth-only" in depth_peer(only_depth(q4), {})[1]
    assert depth_peer(only_depth(FULL), {})[0] == LLAMACPP_BF16
    with pytest.raises(ValueError, match="depth-only"):
        only_depth(with_depths(FULL, ()))


def test_a_depth_only_bench_runs_the_sweep_alone(reports, capsys):
    rc = bench_cli.main(["--quick", "--depth-only", "--depths", "64", "--models", EMBEDDED, "--skip-llamacpp",
                         "--device", "sim"])
    assert rc == 0
    (jpath,) = reports.glob("bench-*.json")
    data = json.loads(jpath.read_text())
    (m,) = data["models"]
    assert data["plan"]["depth_only"] and m["depth_only"] and set(m) == {"model", "quant", "depth_only", "depth"}
    s = m["depth"]["by_depth"]["64"]["runtimes"][OURS]
    assert s["decode_tok_s"] > 0 and len(s["runs"]["ttft_s"]) == QUICK.depth_rounds
    md = jpath.with_suffix(".md").read_text()
    assert "decode at depth only" in md and "## Decode at depth" in md and "| metric |" not in md
    with pytest.raises(SystemExit) as refused:                 # nothing left to run: argparse's exit 2
        bench_cli.main(["--quick", "--depth-only", "--depths", "none", "--skip-llamacpp"])
    assert refused.value.code == 2 and "--depth-only needs at least one depth" in capsys.readouterr().err


def test_a_bench_can_measure_a_subset_of_llama_cpp_s_types_of_the_class(capsys):
    q4 = FULL.for_quant("q4nx")
    assert with_types(q4, ("q4_k_m", "q4_0")).gguf_types == ("q4_0", "q4_k_m")      # the class's order
    with pytest.raises(ValueError, match="with bf16 weights the peers are bf16, q8_0"):
        with_types(FULL, ("q4_0",))
    with pytest.raises(ValueError, match=r"\(none\)"):
        with_types(q4, ())
    with pytest.raises(SystemExit) as refused:
        bench_cli.main(["--quick", "--quant", "q4nx", "--llamacpp-types", "q4_0,q5_k", "--skip-llamacpp"])
    assert refused.value.code == 2 and "llama.cpp types q5_k: with q4nx weights" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        bench_cli.main(["--quick", "--depth-only", "--llamacpp-types", "q4_k_m", "--skip-llamacpp"])
    assert refused.value.code == 2 and "does not apply to --depth-only" in capsys.readouterr().err


_DEPTH_SIDE = """
from bench.protocol import child_main

class Runner:
    class R:
        def __init__(self, t):
            self.top1 = t
    def __init__(self, n_ctx):
        self.n_ctx, self.used = n_ctx, 0
    def prefill(self, ids):
        assert len(ids) <= self.n_ctx, (len(ids), self.n_ctx)
        self.used = len(ids)
        return self.R(1)
    def decode_step(self, token, pos):
        assert pos == self.used < self.n_ctx, (pos, self.used, self.n_ctx)
        self.used += 1
        return self.R(token)

def make_runner(job):
    return Runner(job["max_context"]), {"n_ctx": job["max_context"], "resident_bytes": {"static": 1000}}

raise SystemExit(child_main(make_runner))
"""


def test_the_depth_sweep_takes_turns_depth_by_depth_and_sizes_each_context(tmp_path, monkeypatch):
    """Stand-ins for both runtimes check that every prompt and decode step fits their context:
    ours holds the deepest depth plus its steps in every child, llama.cpp each child's own."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "depth_side.py").write_text(_DEPTH_SIDE)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    order = []
    real_run_side = bench_run.run_side

    def run_side(module, job, workdir, python, log, timeout_s=bench_run.SIDE_TIMEOUT_S):
        prompt = job["prompts"].get(str(job.get(DEPTH)), [])
        order.append((workdir.parent.name, job.get(DEPTH), job["max_context"], len(prompt), bool(job.get(PREPARE))))
        return real_run_side(module, job, workdir, python, log, timeout_s)

    lc = f"{LLAMACPP} bf16"
    sides = [(OURS, "depth_side", {"model": "m"}, sys.executable), (HF, "bench.side_hf", {}, sys.executable),
             (lc, "depth_side", {"gguf": "g"}, sys.executable)]
    monkeypatch.setattr(bench_run, "_sides", lambda *a: sides)
    monkeypatch.setattr(bench_run, "run_side", run_side)
    notes: list[str] = []
    raw = bench_run.bench_depths(EMBEDDED, QUICK, "sim", None, tmp_path / "w", notes, lambda _: None,
                                 {lc: _raw({32: [0.1]}, [5.0], 1)})
    n = QUICK.depth_decode
    assert order[0] == (OURS, None, 256 + n, 0, True)                  # the untimed build for the sweep, first
    assert order[1:] == [(name, d, 256 + n if name == OURS else d + n, d, False)
                         for _ in range(QUICK.depth_rounds) for d in (64, 256) for name in (OURS, "llama.cpp-bf16")]
    assert raw["peer"] == lc and raw["kept"] == [64, 256] and raw["max_context"][OURS] == 256 + n
    assert set(raw["runs"]) == {OURS, lc}                               # HF is not in the sweep
    for side in raw["runs"].values():
        for runs in side.values():
            assert "error" not in runs and len(runs["ttft_s"]) == len(runs["decode_tok_s"]) == QUICK.depth_rounds
    d = summarize_depths(raw, QUICK)
    assert all(r["ratios"]["decode"] > 0 for r in d["by_depth"].values())
    assert [t["status"] != "n/a" for t in d["targets"]] == [True, True, True, True]


def test_an_interrupted_depth_sweep_keeps_and_reports_what_finished(tmp_path, monkeypatch):
    """Ctrl-C in the second round's second child: the first round and the child that finished
    are summarized, with a note; the deepest depth of round 1 is there, so memory is too."""
    lc = f"{LLAMACPP} bf16"
    calls = []

    def run_side(module, job, workdir, python, log, timeout_s=bench_run.SIDE_TIMEOUT_S):
        calls.append(job.get(DEPTH))
        if len(calls) == 1 + 2 * len(QUICK.depths) + 2:         # the prepare child, round 1, then two more
            raise KeyboardInterrupt
        d = job.get(DEPTH) or 64
        return {"ttft_s": d / 1000, "decode_tok_s": 1000 / d, "peak_rss_bytes": (1 << 30) + d * 4096,
                "load_s": 1.0, "other_cores": 0.0, "wall_s": 1.0, "info": {"resident_bytes": {"static": 1 << 30}}}

    monkeypatch.setattr(bench_run, "_sides", lambda *a: [(OURS, "m", {}, sys.executable), (lc, "m", {}, sys.executable)])
    monkeypatch.setattr(bench_run, "run_side", run_side)
    notes: list[str] = []
    raw = bench_run.bench_depths(EMBEDDED, QUICK, "sim", None, tmp_path, notes, lambda _: None,
                                 {lc: _raw({32: [0.1]}, [5.0], 1)})
    assert raw["interrupted"] and "interrupted (Ctrl-C) after 1 whole round(s) of 2" in notes[-1]
    first, deep = (str(d) for d in QUICK.depths)
    assert len(raw["runs"][OURS][first]["decode_tok_s"]) == 2 and len(raw["runs"][lc][first]["decode_tok_s"]) == 1
    assert len(raw["runs"][OURS][deep]["decode_tok_s"]) == 1
    d = summarize_depths(raw, QUICK)
    assert d["by_depth"][deep]["ratios"]["decode"] == pytest.approx(1.0) and "ratio" in d["memory"]


def test_the_depth_plot_is_a_png_with_a_line_per_runtime(tmp_path):
    lc = f"{LLAMACPP} bf16"
    by_depth = {str(k): {"runtimes": {OURS: {"decode_tok_s": r}, lc: {"decode_tok_s": r / 1.3}}, "ratios": {}}
                for k, r in ((1024, 24.0), (4096, 21.0), (32768, 12.0))}
    m = {"model": "llama1b-shape", "quant": "bf16", "depth": {"kept": [1024, 4096, 32768], "by_depth": by_depth,
                                                              "n_decode": 64}}
    machine = {"cpu": "AMD EPYC", "core": "Zen 5 (family 26, model 2)", "cores": 2}
    path = plot_depths([m, {"model": "no sweep", "runtimes": {}}], tmp_path / "depth.png", machine)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
        assert im.format == "PNG" and im.size[0] >= 400
    assert plot_depths([{"model": "x", "depth": {"kept": [], "by_depth": {}}}], tmp_path / "none.png", machine) is None
    assert not (tmp_path / "none.png").exists()

def test_a_fused_session_s_npu_estimate_is_the_fused_table():
    """Ours decoding fused (its info says so): the estimate is the fused design's, per context,
    beside the layers design; the anchors only for the model they were measured on."""
    import conftest
    from bench.render import fused_estimate

    gib = 1 << 30
    raw = {OURS: _raw({32: [0.1]}, [50.0], gib, info={"kv_cache_bytes": gib // 8, "decode": "fused"}),
           HF: _raw({32: [0.2]}, [40.0], gib)}
    m = summarize_model("tiny", conftest.TINY, False, (32,), 512, raw, 30e9)
    est = m["npu_estimate"]
    assert est["decode"] == "fused" and est["anchors"] is None and est["ttft_s"]["32"] > 0
    (row,) = est["depths"]
    assert row["depth"] == 1024 and 0 < row["tok_s"] < row["bound_tok_s"] and row["target"] is None
    text = fused_estimate(est)
    assert "NPU estimate of the fused decode (cost model, not a measurement)" in text and "FastFlowLM" not in text
    assert "target" not in text
    raw[OURS]["info"]["decode"] = "layers"
    assert "depths" not in summarize_model("tiny", conftest.TINY, False, (32,), 512, raw, 30e9)["npu_estimate"]


@pytest.mark.slow
def test_the_fused_estimate_of_llama_1b_q4nx_sits_beside_the_published_anchors():
    from bench.render import fused_estimate
    from bench.summary import npu_estimate

    est = npu_estimate(LLAMA_1B, (128, 2048), "q4nx", "fused")
    assert [d["depth"] for d in est["depths"]] == [1024, 2048, 8192, 32768, 131072]
    assert est["depths"][0]["upstream_tok_s"] == 68.22 and est["depths"][-1]["fastflowlm_tok_s"] == 13.6
    text = fused_estimate(est)
    assert "| 131072 |" in text and "the bytes bound is below it" in text and "FastFlowLM" in text


def test_under_load_ratios_and_targets_on_constructed_numbers():
    """Ours under load against ours on one idle thread and against llama.cpp under the same load."""
    plan = replace(FULL, quant="q4nx", gguf_types=("q4_0",))
    peer = f"{LLAMACPP} q4_0"
    run = lambda ttft, dec, held: {"ttft_s": {"128": [ttft]}, "decode_tok_s": [dec], "busy": {"held_cores": held},
                                   "info": {"threads": "threads: 1 of 2"}}
    raw = {"peer": peer, "peer_reason": "fastest", "idle_one_thread": [run(0.3, 40.0, 0), run(0.3, 50.0, 0)],
           "loads": {"1": {OURS: [run(0.4, 44.0, 1.0)], peer: [run(0.8, 20.0, 0.9), run(1.0, 30.0, 0.9)]}}}
    s = summarize_load(raw, plan)
    rat = s["by_load"]["1"]["ratios"]
    assert s["one_thread_idle"]["decode_tok_s"] == 45.0
    assert rat["decode_vs_own_one_thread"] == pytest.approx(44 / 45)
    assert rat["decode_vs_peer"] == pytest.approx(44 / 25) and rat["ttft_vs_peer"] == pytest.approx(0.4 / 0.9)
    assert [t["status"] for t in s["targets"]] == ["PASS", "PASS", "PASS"]
    raw["loads"]["1"][OURS] = [run(2.0, 30.0, 0.5)]
    assert [t["status"] for t in summarize_load(raw, plan)["targets"]] == ["MISS", "PASS", "MISS"]
    assert loads(2) == [1] and loads(3) == [1] and loads(8) == [1, 4]


def test_busy_loops_hold_cores_while_the_block_runs():
    """The loops a child under load starts really run, and are gone after it."""
    with busy_loops(1) as held:
        time.sleep(0.4)
        got = held()
    assert got is not None and got > 0.5
    with busy_loops(0) as held:
        assert held() is None
