"""The server's one model on one device: a bounded arrival-order queue and one worker thread.

Generation is blocking CPU (or NPU-driver) code that owns the session's single KV cache, so
requests never run side by side and never on the event loop: the HTTP side puts a `Job` in
the queue and reads what the worker posts back through the loop (`loop.call_soon_threadsafe`).
A full queue refuses the request at once rather than letting waits grow without bound.

The session remembers which token ids sit in its KV cache, so a prompt that extends them (the
next turn of a conversation, the same system prompt, a repeated request) prefills only what
is new. Matching is on token ids, so it works for any client, with no conversation identifiers.

A job stops early when its client goes away or the server shuts down (`Session.generate`
checks `should_stop` once per token), and where its text reaches one of its stop strings
(generation does that too, and streams nothing of them).
"""
from __future__ import annotations

import asyncio
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llama_runtime.generation.logprobs import TokenLogprob
from llama_runtime.generation.sampling import SamplingParams
from llama_runtime.generation.session import Session
from llama_runtime.serve.events import Done, Embedding, Event, Failed, PromptScores, TextPiece, ToolCall
from llama_runtime.serve.tool_calls import CallHold, ToolRequest

DEFAULT_QUEUE_SIZE = 16
# Weight of the latest job in the running mean of job durations that Retry-After is based on.
# A slot frees when the running job ends, so Retry-After is that job's expected remainder,
# not the time to drain the whole queue (which would send clients away for far too long).
_DURATION_EMA = 0.3
_SHUTDOWN = object()


class QueueFull(Exception):
    """Every queue slot is taken; `retry_after_s` estimates when one frees up."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the server is busy: {retry_after_s} s until a queue slot is likely free")
        self.retry_after_s = retry_after_s


@dataclass
class Job:
    """One request's generation. `events` receives what events.py lists, ending with exactly
    one `Done` or `Failed`. `logprobs` = k asks for each token's score and k alternatives;
    `score_prompt` for the prompt's too, which reads the whole prompt again (no reuse of the
    cache). With `tools`, an answer that is a call of one comes as a `ToolCall`, not as text."""
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None
    score_prompt: bool = False
    constraint: object = None           # constrained.Constraint: the answer must match its grammar
    tools: ToolRequest | None = None
    embed: bool = False                 # the prompt's vector (`Session.embed`) instead of an answer
    id: str = ""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled_by: str | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)

    def cancel(self, by: str = "client") -> None:
        """Stop at the next token (or skip the job if it has not started); safe from any thread."""
        if self.cancelled_by is None:
            self.cancelled_by = by

    def _post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:    # the loop is closed: nobody is listening any more
            pass


class Worker:
    """Runs jobs one at a time, in arrival order, on a session it alone uses."""

    def __init__(self, session: Session, queue_size: int = DEFAULT_QUEUE_SIZE, log: Callable[[str], None] = print):
        if queue_size < 1:
            raise ValueError(f"the queue needs at least one slot (got {queue_size})")
        self.session = session
        self.log = log
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._current: Job | None = None
        self._current_started = 0.0
        self._mean_job_s = 1.0
        self._ids = itertools.count(1)
        # Called on the worker thread with each finished job and its Done (the metrics).
        self.observers: list[Callable[[Job, Done], None]] = []
        self._thread = threading.Thread(target=self._run, name="generation-worker", daemon=True)
        self._thread.start()

    @property
    def max_context(self) -> int:
        return self.session.model.max_context

    @property
    def queued(self) -> int:
        """Jobs waiting for the model (not the running one)."""
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None or not self._queue.empty()

    def submit(self, job: Job) -> Job:
        """Queue `job` or raise QueueFull; never blocks the caller."""
        job.id = job.id or f"{next(self._ids):06d}"
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            running_s = time.perf_counter() - self._current_started if self._current is not None else 0.0
            raise QueueFull(max(1, math.ceil(self._mean_job_s - running_s))) from None
        return job

    def cancel_all(self, by: str = "shutdown") -> None:
        """Stop the running job at its next token and every queued one before it starts."""
        current = self._current
        if current is not None:
            current.cancel(by)
        with self._queue.mutex:
            pending = [j for j in self._queue.queue if isinstance(j, Job)]
        for j in pending:
            j.cancel(by)

    def stop(self, timeout: float | None = None) -> None:
        self.cancel_all("shutdown")
        while True:
            try:
                self._queue.put(_SHUTDOWN, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _SHUTDOWN:
                return
            self._current, self._current_started = job, time.perf_counter()
            try:
                if job.cancelled_by is not None:
                    self.log(f"[serve] {job.id} prompt {len(job.prompt_ids)} tokens, never started: queued "
                             f"{time.perf_counter() - job.enqueued_at:.2f} s, cancelled by {job.cancelled_by}")
                    job._post(Done("", None, len(job.prompt_ids), 0, 0, job.cancelled_by))
                elif job.embed:
                    self._embed(job)
                else:
                    self._generate(job)
            except Exception as e:  # noqa: BLE001 -- a bug or a device failure: report it, keep serving
                self.log(f"[serve] {job.id} failed: {type(e).__name__}: {e}")
                job._post(Failed(e))
            finally:
                self._current = None

    def _finish(self, job: Job, done: Done) -> None:
        for observe in self.observers:
            observe(job, done)
        job._post(done)

    def _embed(self, job: Job) -> None:
        started = time.perf_counter()
        vector = self.session.embed(job.prompt_ids)
        elapsed = time.perf_counter() - started
        self.log(f"[serve] {job.id} embedding of {len(job.prompt_ids)} tokens in {elapsed:.3f} s")
        job._post(Embedding(vector.tolist()))
        self._finish(job, Done("", "stop", len(job.prompt_ids), 0, 0, queued_s=started - job.enqueued_at,
                               ttft_s=elapsed))

    def _generate(self, job: Job) -> None:
        ids = job.prompt_ids
        started = time.perf_counter()
        if job.score_prompt:
            job._post(PromptScores(self.session.score_prompt(ids, job.logprobs or 0, job.sampling)))
        pieces: list[str] = []
        scores: list[TokenLogprob] = []     # since the last piece posted
        calls = CallHold(job.tools) if job.tools is not None else None

        def post(piece: TextPiece) -> None:
            shown = piece if calls is None else calls.push(piece)
            if shown is not None:
                job._post(shown)

        def on_text(piece: str) -> None:
            pieces.append(piece)
            post(TextPiece(piece, scores[:]))
            scores.clear()

        r = self.session.generate(ids, job.max_tokens, on_text, job.sampling,
                                  should_stop=lambda: job.cancelled_by is not None, logprobs=job.logprobs,
                                  on_logprob=scores.append, constraint=job.constraint, stop=job.stops)
        # Scoring read the whole prompt, so nothing of it was reused, whatever the cache held.
        reused = 0 if job.score_prompt else r.reused_tokens
        elapsed = time.perf_counter() - started
        self._mean_job_s += _DURATION_EMA * (elapsed - self._mean_job_s)
        if scores:
            post(TextPiece("", scores[:]))
        if r.stop_reason in ("end_token", "stop_string"):
            reason = "stop"
        elif r.stop_reason in ("n_tokens", "context_limit"):
            reason = "length"
        else:
            reason = None
        last = calls.finish(reason == "stop") if calls is not None else None
        if last is not None:
            job._post(last)
            if isinstance(last, ToolCall):
                reason = "tool_calls"
        by = job.cancelled_by if reason is None else None
        wait = started - job.enqueued_at
        out = Done("".join(pieces), reason, len(ids), reused, len(r.tokens), by, r.logprobs, wait, r.ttft_s,
                   r.decode_tokens_per_s)
        self.log(f"[serve] {job.id} prompt {len(ids)} tokens, {reused} reused from the cache, {len(r.tokens)} generated, "
                 f"queued {wait:.2f} s, TTFT {r.ttft_s:.3f} s, {r.decode_tokens_per_s:.2f} tok/s, "
                 f"finish {reason or 'cancelled by ' + str(by)}")
        self._finish(job, out)
