"""The serving worker's queue arithmetic, with a stand-in session whose answers take as long
as the test says, so the estimates can be checked without a model."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from llama_runtime.generation.sampling import SamplingParams
from llama_runtime.serve.worker import Job, QueueFull, Worker


class HeldSession:
    """Generation that lasts until `release` is set; reports one token."""

    def __init__(self):
        self.model = SimpleNamespace(max_context=64)
        self.release = threading.Event()
        self.started = threading.Event()

    def generate(self, ids, n_tokens, on_text, sampling, start=0, history=None, should_stop=None, **scoring):
        self.started.set()
        self.release.wait(10)
        return SimpleNamespace(tokens=[1], cached=start + len(ids) + 1, stop_reason="n_tokens", ttft_s=0.0,
                               decode_tokens_per_s=0.0, logprobs=[])


def test_retry_after_is_the_wait_for_one_slot_not_for_the_whole_queue():
    session, lines = HeldSession(), []
    worker = Worker(session, queue_size=3, log=lines.append)
    loop = asyncio.new_event_loop()
    try:
        job = lambda: Job([1, 2], 1, SamplingParams(), (), loop)
        worker.submit(job())
        assert session.started.wait(5)
        for _ in range(3):
            worker.submit(job())
        worker._mean_job_s = 4.0        # as if recent answers took 4 s each
        time.sleep(1.1)                 # the running one has had 1 s of them
        with pytest.raises(QueueFull) as e:
            worker.submit(job())
        # A slot frees when the running answer ends: ~3 s, not 4 s for each of 4 jobs ahead.
        assert e.value.retry_after_s == 3
    finally:
        session.release.set()
        worker.stop(timeout=5)
        loop.close()
    # Stopping skips the queued ones; each still gets its log line.
    assert len(lines) == 4 and sum("never started" in l and "cancelled by shutdown" in l for l in lines) == 3
