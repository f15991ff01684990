"""Prometheus metrics of one server process, on its own registry (no module-global metrics).

Every service counts its RPCs by method and status code (the status interceptor does that).
The target adds the latency of each batched step and KV pool usage; the draft its step
latencies and sessions; the gateway, per finished generation, the tokens, tau, stop depths,
prefill latency and mean step latency, and the requests its engine loop holds.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Protocol, Sized

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)



class KVPoolCounts(Protocol):
    num_pages: int
    num_free_pages: int
    num_used_pages: int


class WatchedTarget(Protocol):
    """What the metrics read from a target runtime (the shared library names no service class)."""

    pool: KVPoolCounts
    sessions: Sized


class WatchedDraft(Protocol):
    sessions: Sized


class FinishedGeneration(Protocol):
    """The per-request numbers a finished generation reports (``gateway.request.GenerationStats``)."""

    new_tokens: int
    steps: int
    prefill_seconds: float
    decode_seconds: float
    mean_accepted_length: float
    stop_depth_histogram: list[int]


_TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
_DEPTH_BUCKETS = tuple(float(d) for d in range(0, 17))
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "diffspec_requests", "RPCs handled, by method and final status code", ["method", "code"], registry=r
        )
        self.generated_tokens = Counter("diffspec_generated_tokens", "Tokens streamed to clients", registry=r)
        self.accepted_length = Histogram(
            "diffspec_mean_accepted_length",
            "tau (accepted drafts + 1 per step) of each finished generation",
            buckets=_TAU_BUCKETS,
            registry=r,
        )
        self.stop_depth = Histogram(
            "diffspec_stop_depth",
            "Depth at which each verification step's accepted path stopped",
            buckets=_DEPTH_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "diffspec_step_seconds",
            "Mean latency of one decoding step (propose + verify + accept) of each finished generation",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "diffspec_prefill_seconds",
            "Prefill latency (to the first token) of each generation",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.session_call_seconds = Histogram(
            "diffspec_session_call_seconds",
            "Latency of one batched step at the target or the draft, by call",
            ["call"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.active_generations = Gauge(
            "diffspec_active_generations", "Generations in flight at the gateway", registry=r
        )
        self.kv_pages = Gauge("diffspec_kv_pages", "Target KV pool pages, by state", ["state"], registry=r)
        self.sessions = Gauge("diffspec_sessions", "Open sessions, by service", ["service"], registry=r)

    def serve_http(self, host: str, port: int) -> None:
        """Expose ``/metrics`` on ``host:port`` from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)

    def watch_target(self, target: WatchedTarget) -> None:
        """Read KV pool and session counts from the target at every scrape."""
        pool = target.pool
        self.kv_pages.labels("total").set_function(lambda: pool.num_pages)
        self.kv_pages.labels("free").set_function(lambda: pool.num_free_pages)
        self.kv_pages.labels("used").set_function(lambda: pool.num_used_pages)
        self.sessions.labels("target").set_function(lambda: len(target.sessions))

    def watch_draft(self, draft: WatchedDraft) -> None:
        self.sessions.labels("draft").set_function(lambda: len(draft.sessions))

    @contextmanager
    def time_call(self, call: str) -> Iterator[None]:
        """Time one call (a target or draft step) at the service that runs it."""
        start = time.perf_counter()
        yield
        self.session_call_seconds.labels(call).observe(time.perf_counter() - start)

    def record_generation(self, stats: FinishedGeneration) -> None:
        self.generated_tokens.inc(stats.new_tokens)
        self.prefill_seconds.observe(stats.prefill_seconds)
        if stats.steps:
            self.accepted_length.observe(stats.mean_accepted_length)
            self.step_seconds.observe(stats.decode_seconds / stats.steps)
        for depth, count in enumerate(stats.stop_depth_histogram):
            for _ in range(count):
                self.stop_depth.observe(depth)
