"""QUANT=q4nx end to end on the simulated NPU: the embedded model (its GGUF's 4-bit values) through
the same prefill and decode code as bf16, held to a bf16 session run on the same weights
dequantized, which is what `make verify QUANT=q4nx` holds it to on the HF side."""
from __future__ import annotations

import os

import pytest
import torch
from q4nx_twin import dequantized_model

from llama_base import q4nx
from llama_base.errors import CheckpointError
from verify import reference as ref
from llama_runtime.engine.decode import decode_step
from llama_runtime.engine.head_rescore import TOP_K, rescore
from llama_runtime.engine.prefill import prefill
from llama_runtime.checkpoints.q4nx_weights import lm_head_rows
from llama_runtime.generation.session import build_session


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return build_session("embedded", "sim", max_context=1024, cache_dir=tmp_path_factory.mktemp("kernels"), decode="layers",
                         buckets=(64, 256), log=lambda s: None, quant="q4nx")


@pytest.fixture(scope="module")
def dequantized(session):
    """A bf16 device model of the q4nx session's own weights, dequantized."""
    return dequantized_model(session)


def test_q4nx_groups_run_with_the_same_calls_as_bf16(session):
    layers = session.config.num_hidden_layers
    assert all(g.quant == "q4nx" for g in session.model.all_groups() if g.kind != "flash_attn")
    ids = session.encode("Hello there")
    before = session.device.counters.runs
    logits = prefill(session.model, ids)
    assert session.device.counters.runs - before == 3 * (layers - 1) + 3
    before = session.device.counters.runs
    decode_step(session.model, int(logits.argmax()), len(ids))
    assert session.device.counters.runs - before == 2 * layers + 1


def test_the_weights_are_resident_once_in_five_bits(session):
    cfg = session.config
    per_layer = sum(q4nx.nbytes(*s) for s in
                    [(cfg.q_dim, cfg.hidden_size), (cfg.kv_dim, cfg.hidden_size), (cfg.kv_dim, cfg.hidden_size),
                     (cfg.hidden_size, cfg.q_dim), (cfg.intermediate_size, cfg.hidden_size),
                     (cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)])
    norms = 2 * cfg.hidden_size * 2
    head = q4nx.nbytes(lm_head_rows(cfg), cfg.hidden_size)
    assert session.kc.resident_bytes()["static"] == cfg.num_hidden_layers * (per_layer + norms) + head


@pytest.fixture
def raw_head(session):
    """The q4nx session with its 4-bit head's logits as the device computed them (no rescoring)."""
    session.model.rescore_k = 0
    yield session
    session.model.rescore_k = TOP_K


def test_q4nx_prefill_and_decode_match_bf16_on_the_dequantized_weights(raw_head, dequantized):
    session = raw_head
    ids = session.encode("What is the capital of Japan?")
    ours = prefill(session.model, ids)
    ref = prefill(dequantized, ids)
    # Prefill multiplies exactly the dequantized bf16 weights: only summation order differs;
    # except on a class that prefills on decode's integer contract, held to decode's bound.
    from cpu_kernels import native_cpu
    assert int(ours.argmax()) == int(ref.argmax())
    bound = 0.999 if native_cpu.integer_q4nx_gemm(native_cpu.isa()) else 0.9999
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=0) > bound
    tok = int(ours.argmax())
    d_ours, d_ref = decode_step(session.model, tok, len(ids)), decode_step(dequantized, tok, len(ids))
    # Decode folds the dequantization into its sums: no bf16 rounding of each weight, but its
    # activations rounded to 14 bits, or to one byte (1/254 of a group's largest) on a narrow
    # class; over 30 layers and the raw 4-bit head that moves the logits' direction more
    # (measured: cosine 0.9978 on `avx2`).
    assert int(d_ours.argmax()) == int(d_ref.argmax())
    narrow = native_cpu.q4nx_activation_bytes(native_cpu.isa()) == q4nx.NARROW
    assert torch.nn.functional.cosine_similarity(d_ours, d_ref, dim=0) > (0.995 if narrow else 0.999)


def test_the_q4nx_embedded_model_answers(session):
    r = session.generate("What is the capital of Japan?", 16)
    assert "Tokyo" in r.text


def test_chunked_q4nx_prefill_equals_single_shot(session):
    ids = session.encode("Name three rivers of Europe and the seas they flow into, one per line.")
    whole = prefill(session.model, ids).clone()
    first = prefill(session.model, ids[:20])
    del first
    rest = prefill(session.model, ids[20:], start=20)
    assert int(whole.argmax()) == int(rest.argmax())
    assert torch.nn.functional.cosine_similarity(whole, rest, dim=0) > 0.999



def test_file_rows_serve_recent_rows_from_their_cache(tmp_path):
    """A head reader keeps the rows it read last (up to its cache's size): they come back from
    memory even after the file changed, rows it no longer holds come from the file, and the
    cache's two maps stay each other's inverse through calls with repeats and more new rows
    than it holds."""
    from safetensors.torch import save_file

    from cpu_kernels import native_cpu
    from llama_runtime.checkpoints.safetensors_io import Checkpoint

    if native_cpu._library() is None:
        pytest.skip("no native library on this machine")
    table = torch.randn(64, 24).to(torch.bfloat16)
    save_file({"t": table}, tmp_path / "m.safetensors")
    ck = Checkpoint(tmp_path)
    rows = ck.rows_of(ck.get("t", (64, 24)), cache_bytes=8 * 24 * 2)
    g = torch.Generator().manual_seed(0)
    for n in (3, 8, 20, 5, 64, 1, 6):                 # past the capacity of 8, and repeats
        ids = torch.randint(0, 64, (n,), generator=g)
        assert torch.equal(rows(ids), table[ids])
        c = rows.cache
        held = (c.id_of >= 0).nonzero().flatten()
        assert c.capacity == 8 and len(held) == int((c.slot_of >= 0).sum()) <= 8
        assert torch.equal(c.slot_of[c.id_of[held]].long(), held)
    kept = (rows.cache.slot_of >= 0).nonzero().flatten()
    gone = (rows.cache.slot_of < 0).nonzero().flatten()[:4]
    with open(tmp_path / "m.safetensors", "r+b") as f:       # the same file, every value changed
        f.seek(rows.offset)
        f.write((-table).view(torch.uint8).numpy().tobytes())
    assert torch.equal(rows(kept), table[kept])                # from the cache
    assert torch.equal(rows(gone), -table[gone])               # from the file as it is now

def test_rescoring_puts_the_exact_products_on_the_leading_candidates_only():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1000, 64, generator=g).to(torch.bfloat16)
    h = torch.randn(64, generator=g).to(torch.bfloat16)
    approx = (rows.float() @ h.float()) + 0.5 * torch.randn(1000, generator=g)
    logits = approx.clone()
    idx = rescore(logits, h, lambda i: rows.index_select(0, i), 10)
    assert sorted(idx.tolist()) == sorted(approx.topk(10).indices.tolist())
    exact = (rows.float() @ h.float()).to(torch.bfloat16).float()
    assert torch.equal(logits[idx], exact[idx])
    rest = torch.ones(1000, dtype=torch.bool)
    rest[idx] = False
    assert torch.equal(logits[rest], approx[rest])


def test_the_table_rows_are_read_from_the_checkpoint_file_as_the_table_holds_them(session):
    from llama_runtime.checkpoints.safetensors_io import FileRows

    assert isinstance(session.model.head_rows, FileRows) and isinstance(session.model.embed_rows, FileRows)
    ids = torch.tensor([0, 7, session.config.vocab_size - 1, 7])
    assert torch.equal(session.model.head_rows(ids), session.model.embed.index_select(0, ids))
    assert torch.equal(session.model.embed_tokens(ids.tolist()), session.model.embed.index_select(0, ids))
    with pytest.raises(IndexError):
        session.model.head_rows(torch.tensor([session.config.vocab_size]))


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_file_rows_read_the_rows_asked_for_and_name_what_went_wrong(tmp_path, monkeypatch, native):
    """Both readers (one native call for all rows, or a pread per row where the library is
    unavailable) give the table's rows in the order asked, and tell an id outside the table
    from a file that shrank under the runtime."""
    from safetensors.torch import save_file

    from cpu_kernels import native_cpu, native_rows
    from llama_runtime.checkpoints.safetensors_io import Checkpoint, FileRows

    if native and native_cpu.library() is None:
        pytest.skip("no native library on this machine")
    if not native:
        monkeypatch.setattr(native_rows, "read_rows", lambda *a: None)
        monkeypatch.setattr(native_rows, "read_row", lambda *a: None)
    table = torch.randn(50, 24).to(torch.bfloat16)
    save_file({"pad": torch.ones(3, dtype=torch.bfloat16), "t": table}, tmp_path / "m.safetensors")
    ck = Checkpoint(tmp_path)
    rows = ck.rows_of(ck.get("t", (50, 24)))
    assert isinstance(rows, FileRows)
    ids = torch.tensor([49, 0, 7, 7, 13])
    assert torch.equal(rows(ids), table[ids])
    one = torch.zeros(24, dtype=torch.bfloat16)       # one row into a buffer of the caller's
    assert rows.read_into(13, one) is native
    assert torch.equal(one, table[13] if native else torch.zeros(24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a row of 24"):
        rows.read_into(13, torch.zeros(25, dtype=torch.bfloat16))
    if hasattr(os, "posix_fadvise"):                  # out of the page cache: the rows come from disk
        with open(tmp_path / "m.safetensors", "rb+") as h:
            os.fsync(h.fileno())                      # (dirty pages would stay)
        os.posix_fadvise(rows._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert torch.equal(rows(ids), table[ids])
    advised = []
    monkeypatch.setattr("os.posix_fadvise", lambda fd, off, n, how: advised.append((off, n, how)))
    rows.prefetch().join()                            # the table's own bytes, not the file's
    assert advised == [(rows.offset, 50 * 24 * 2, os.POSIX_FADV_WILLNEED)]
    assert rows.offset > 0
    with pytest.raises(IndexError, match="row 50 of a 50-row"):
        rows(torch.tensor([1, 50]))
    if native:
        with pytest.raises(IndexError, match="row 50 of a 50-row"):
            rows.read_into(50, one)
    f = tmp_path / "m.safetensors"
    f.write_bytes(f.read_bytes()[:-24 * 2 * 5])          # the last 5 rows gone
    with pytest.raises(CheckpointError, match="short read of row 46"):
        rows(torch.tensor([0, 46]))
    if native:
        with pytest.raises(CheckpointError, match="short read of row 46"):
            rows.read_into(46, one)


@pytest.mark.parametrize("cache_rows", [0, 40, 1000], ids=["uncached", "cache-smaller-than-k", "cache-holds-all"])
def test_file_rows_rescore_in_one_call_as_the_steps_do(tmp_path, cache_rows):
    """`FileRows.rescore` (one native call) chooses the candidates the steps choose, ties and
    all, and leaves the logits bit for bit as `rescore` does with a plain row lookup, token
    after token through its row cache; where it cannot serve (NaN logits) the steps still do,
    and a row it cannot read leaves the logits untouched."""
    from safetensors.torch import save_file

    from cpu_kernels import native_cpu
    from llama_runtime.checkpoints.safetensors_io import Checkpoint, FileRows

    if native_cpu._library() is None:
        pytest.skip("no native library on this machine")
    n, width, k = 3000, 72, 60         # 72 and 60: the dot's and the rounding's last vectors part ones
    g = torch.Generator().manual_seed(11)
    table = torch.randn(n, width, generator=g).to(torch.bfloat16)
    save_file({"pad": torch.ones(5, dtype=torch.bfloat16), "t": table}, tmp_path / "m.safetensors")
    ck = Checkpoint(tmp_path)
    rows = ck.rows_of(ck.get("t", (n, width)), cache_bytes=cache_rows * width * 2)
    assert isinstance(rows, FileRows)
    for step in range(4):
        h = torch.randn(width, generator=g).to(torch.bfloat16)
        approx = (table.float() @ h.float() + 0.3 * torch.randn(n, generator=g))
        approx = (approx * 4).round() / 4          # a 4-bit head's logits tie
        approx[step * 7] = float("nan")
        fused, steps = approx.clone(), approx.clone()
        ids = rows.rescore(fused, h, k)
        want = rescore(steps, h, lambda i: table.index_select(0, i), k)
        assert ids is not None, step
        assert sorted(ids.tolist()) == sorted(want.tolist()), step
        assert torch.equal(fused.nan_to_num(), steps.nan_to_num()) and fused.isnan().sum() == 1, step
        # The head's bf16 logits widened in the same call, into a tensor holding anything.
        source = approx.to(torch.bfloat16)
        widened, steps = torch.full((n,), 7.0), source.float()
        ids = rows.rescore(widened, h, k, source)
        rescore(steps, h, lambda i: table.index_select(0, i), k)
        assert ids is not None and torch.equal(widened.nan_to_num(), steps.nan_to_num()), step
        plain = torch.full((n,), 7.0)                 # the steps themselves widen a source too
        rescore(plain, h, lambda i: table.index_select(0, i), k, source)
        assert torch.equal(plain.nan_to_num(), steps.nan_to_num()), step
    mostly_nan = torch.full((n,), float("nan"))
    mostly_nan[:10] = torch.arange(10.0)
    assert rows.rescore(mostly_nan.clone(), h, 11) is None      # fewer than k values: the steps' fallback
    widened = torch.zeros(n)
    assert rows.rescore(widened, h, 11, mostly_nan.to(torch.bfloat16)) is None
    assert torch.equal(widened.nan_to_num(), mostly_nan.nan_to_num())     # widened, nothing else
    f = tmp_path / "m.safetensors"
    f.write_bytes(f.read_bytes()[:-width * 2 * 5])              # the last 5 rows gone
    last = torch.zeros(n)
    last[n - 1] = 100.0
    before = last.clone()
    assert rows.cache is None or rows.cache.slot_of[n - 1] < 0    # the row must come from the file
    with pytest.raises(CheckpointError, match=f"short read of row {n - 1}"):
        rows.rescore(last, h, k)
    assert torch.equal(last, before)


def test_a_table_is_asked_for_window_by_window_and_becomes_resident(tmp_path, monkeypatch):
    """One WILLNEED reads at most a readahead window, so the prefetch covers the table in
    windows, every byte once; and where the file's pages can be dropped first, the whole table
    is in the page cache soon after."""
    import ctypes
    import mmap
    import time

    import numpy as np

    from llama_runtime.checkpoints.safetensors_io import PREFETCH_WINDOW, FileRows

    rows_n, width = 5000, 2048     # 20 MB of bf16 rows behind a 1 KiB header: past one call's 8 MiB here
    path = tmp_path / "table.bin"
    path.write_bytes(os.urandom(1024) + os.urandom(rows_n * width * 2))
    rows = FileRows(path, 1024, (rows_n, width), torch.bfloat16)
    total = rows_n * width * 2
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr("os.posix_fadvise", lambda fd, off, n, how: advised.append((off, n, how)))
    rows.prefetch().join()
    starts = range(0, total, PREFETCH_WINDOW)               # the last window a part one
    assert [(off, n) for off, n, _ in advised] == [(1024 + o, min(PREFETCH_WINDOW, total - o)) for o in starts]
    assert total % PREFETCH_WINDOW and len(advised) > 1
    assert {how for _, _, how in advised} == {os.POSIX_FADV_WILLNEED}
    monkeypatch.setattr("os.posix_fadvise", real)

    with open(path, "rb") as h:
        os.fsync(h.fileno())
    real(rows._fd, 0, 0, os.POSIX_FADV_DONTNEED)
    mapped = mmap.mmap(rows._fd, 0, prot=mmap.PROT_READ)
    arr = np.frombuffer(mapped, dtype=np.uint8)
    pages = -(-len(mapped) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None)

    def resident() -> float:
        libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(len(mapped)), vec)
        return sum(v & 1 for v in vec) / pages

    if resident() > 0.5:
        pytest.skip("this file system keeps the file's pages resident")
    rows.prefetch().join()
    deadline = time.monotonic() + 10
    while resident() < 0.99 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident() >= 0.99
    del arr
    mapped.close()


def test_the_session_rescores_the_4_bit_head_from_the_bf16_table(session):
    """Past the device's 4-bit GEMV, the leading logits are the bf16 table's rows times the normed
    row the head was given; the others are the GEMV's."""
    normed = []

    def keep(_layer, name, t):        # both runs capture: a capturing prefill runs every row to the end
        if name == "final_normed":
            normed.append(t.clone())

    ids = session.encode("The river that flows through Paris is")
    rescored = prefill(session.model, ids, capture=keep).clone()
    session.model.rescore_k = 0
    try:
        raw = prefill(session.model, ids, capture=keep).clone()
    finally:
        session.model.rescore_k = TOP_K
    kth = raw.topk(TOP_K).values[-1]          # ties at the K-th value may fall either side
    above, below = raw > kth, raw < kth
    assert torch.equal(normed[0], normed[1])
    assert int(above.sum()) > TOP_K // 2
    table = session.model.embed
    want, floor = ref.logits(normed[-1], table)[above], ref.sum_floor(normed[-1], table)[above]
    # bf16 logits (as a float tensor) of the same products, summed in another order.
    ref.assert_within_ulps(rescored[above].bfloat16(), want, 1, ref.REORDERED, floor=floor)
    with pytest.raises(AssertionError):                                  # the 4-bit logits were not that
        ref.assert_within_ulps(raw[above].bfloat16(), want, 1, ref.REORDERED, floor=floor)
    assert torch.equal(rescored[below], raw[below])


def test_rescoring_brings_the_top_1_token_back_to_bf16_s(session):
    """On real text, the 4-bit head alone changes the top-1 token at about a fifth of positions;
    rescored, it agrees with the bf16 session nearly everywhere (docs/profile.md has the figures)."""
    from verify.eval_text import eval_chunks
    from verify.our_runner import OurRunner
    from verify.scoring import agreement

    (chunk,) = eval_chunks(session.tokenizer, 1, 128)
    bf16 = build_session("embedded", "sim", max_context=256, cache_dir=session.kc.artifacts.root, buckets=(64,),
                         log=lambda s: None)
    _, ref = OurRunner(bf16).score(chunk)
    _, rescored = OurRunner(session).score(chunk)
    session.model.rescore_k = 0
    try:
        _, raw = OurRunner(session).score(chunk)
    finally:
        session.model.rescore_k = TOP_K
    assert agreement(rescored, ref) >= 0.9 and agreement(rescored, ref) >= agreement(raw, ref) + 0.05
