"""`GET /metrics`: the server's figures in Prometheus' text format, through `prometheus_client`
(the Prometheus project's own Python client), so any scraper or dashboard reads them as it
reads every other service's.

What is counted: requests by route and status (an ASGI middleware, so refusals count too), the
queue (waiting jobs, and whether the model is busy), prompt and generated tokens, and the
distributions of queue wait, time to first token and decode rate, observed when each job ends
on the worker. Each app has a registry of its own: two servers in one process (the tests)
never share counts.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

PREFIX = "llama_npu"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
RATE_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 250)
WAIT_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


class Metrics:
    def __init__(self, worker):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        queued = Gauge(f"{PREFIX}_queue_depth", "jobs waiting for the model", registry=r)
        queued.set_function(lambda: worker.queued)
        busy = Gauge(f"{PREFIX}_busy", "1 while a job runs or waits", registry=r)
        busy.set_function(lambda: float(worker.busy))
        self.jobs = Counter(f"{PREFIX}_jobs", "jobs finished, by kind and finish reason", ["kind", "finish"],
                            registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of finished jobs", registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_cached_prompt_tokens", "prompt tokens reused from the KV cache",
                                     registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "tokens generated", registry=r)
        self.wait = Histogram(f"{PREFIX}_queue_wait_seconds", "arrival to start of a job", buckets=WAIT_BUCKETS,
                              registry=r)
        self.ttft = Histogram(f"{PREFIX}_ttft_seconds", "start of prefill to the first token chosen",
                              buckets=TTFT_BUCKETS, registry=r)
        self.rate = Histogram(f"{PREFIX}_decode_tokens_per_second", "decode rate after the first token",
                              buckets=RATE_BUCKETS, registry=r)
        worker.observers.append(self.observe)

    def observe(self, job, done) -> None:
        """A job's Done, on the worker thread (prometheus_client's metrics are thread-safe)."""
        kind = "embedding" if job.embed else "completion"
        self.jobs.labels(kind, done.finish_reason or f"cancelled by {done.cancelled_by}").inc()
        self.prompt_tokens.inc(done.prompt_tokens)
        self.cached_tokens.inc(done.cached_tokens)
        self.completion_tokens.inc(done.completion_tokens)
        self.wait.observe(done.queued_s)
        if done.completion_tokens:
            self.ttft.observe(done.ttft_s)
        if done.completion_tokens > 1 and done.tokens_per_s > 0:
            self.rate.observe(done.tokens_per_s)

    def routes(self, api) -> list[Route]:
        async def metrics(request: Request):
            api._served(request)
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        return [Route("/metrics", metrics, methods=["GET"])]

    def middleware(self, app_routes):
        """Counts every answer by its route's template (bounded labels: an unknown path is
        "other") and status, refusals included."""
        metrics = self

        class CountRequests:
            def __init__(self, app):
                self.app = app

            async def __call__(self, scope, receive, send):
                if scope["type"] != "http":
                    return await self.app(scope, receive, send)
                route = next((r.path for r in app_routes if r.matches(scope)[0] != Match.NONE), "other")

                async def counted(message):
                    if message["type"] == "http.response.start":
                        metrics.requests.labels(route, str(message["status"])).inc()
                    await send(message)

                return await self.app(scope, receive, counted)

        return CountRequests
