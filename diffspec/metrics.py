"""Prometheus metrics of one server process, on its own registry (no module-global metrics).

Every service counts its RPCs by method and status code (the status interceptor does that).
The target adds the latency of each batched step and KV pool usage; the draft its step
latencies and sessions; the gateway, per finished generation, the tokens, tau, stop depths,
prefill latency and mean step latency, the requests its engine loop holds, and, split, the
protobuf bytes of its ``Step`` streams to each peer (``WireTraffic``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sized

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from diffspec.errors import InvalidRequest


class KVPoolCounts(Protocol):
    num_pages: int
    num_free_pages: int
    num_used_pages: int


class WatchedTarget(Protocol):
    """What the metrics read from a target runtime (the shared library names no service class)."""

    pool: KVPoolCounts
    sessions: Sized


class WatchedPrefixCache(Protocol):
    block_tokens: int
    cached_blocks: int
    looked_up_entries: int
    hit_entries: int


class WatchedDraft(Protocol):
    sessions: Sized
    prefix_cache: WatchedPrefixCache | None


class FinishedGeneration(Protocol):
    """The per-request numbers a finished generation reports (``gateway.request.GenerationStats``)."""

    new_tokens: int
    steps: int
    prefill_seconds: float
    decode_seconds: float
    mean_accepted_length: float
    stop_depth_histogram: list[int]


@dataclass
class WireCounters:
    """What crossed one client's ``Step`` stream: the ``ByteSize()`` of every protobuf message (gRPC's
    5-byte frame header and HTTP/2 framing are not counted)."""

    steps: int = 0  # step calls completed
    bytes_sent: int = 0  # client -> service
    bytes_received: int = 0  # service -> client


@dataclass
class WireTraffic:
    """A client's wire counters by kind of step. ``prefill``: the step carried prompt work (a prompt
    chunk to the target; a session start, with its prompt's features, to the draft); ``decode``: it
    did not (trees, accepted tokens and their feature rows only)."""

    prefill: WireCounters = field(default_factory=WireCounters)
    decode: WireCounters = field(default_factory=WireCounters)

    def count(self, prefill: bool, bytes_sent: int, bytes_received: int) -> None:
        counters = self.prefill if prefill else self.decode
        counters.steps += 1
        counters.bytes_sent += bytes_sent
        counters.bytes_received += bytes_received


class _WireCollector:
    """Reads every watched client's ``WireTraffic`` at each scrape (the engine loop only adds ints)."""

    def __init__(self) -> None:
        self.peers: dict[str, WireTraffic] = {}  # "target" / "draft" -> its client's traffic

    def collect(self) -> Iterator[CounterMetricFamily]:
        steps = CounterMetricFamily(
            "diffspec_wire_steps", "Step calls to a peer, by kind of step", labels=["peer", "step"]
        )
        wire_bytes = CounterMetricFamily(
            "diffspec_wire_bytes",
            "Protobuf bytes on a peer's Step stream, by direction (sent/received) and kind of step",
            labels=["peer", "direction", "step"],
        )
        for peer, traffic in self.peers.items():
            for kind, counters in (("prefill", traffic.prefill), ("decode", traffic.decode)):
                steps.add_metric([peer, kind], counters.steps)
                wire_bytes.add_metric([peer, "sent", kind], counters.bytes_sent)
                wire_bytes.add_metric([peer, "received", kind], counters.bytes_received)
        yield steps
        yield wire_bytes


class _PrefixCacheCollector:
    """The draft's prefix cache at each scrape: the prompt entries lookups asked for and found (their ratio is
    the hit rate), and the entries it holds."""

    def __init__(self, cache: WatchedPrefixCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        looked_up = CounterMetricFamily(
            "diffspec_draft_prefix_cache_entries",
            "Prompt entries the draft's prefix-cache lookups could reuse (looked_up) and found (hit)",
            labels=["result"],
        )
        looked_up.add_metric(["looked_up"], self.cache.looked_up_entries)
        looked_up.add_metric(["hit"], self.cache.hit_entries)
        yield looked_up
        yield GaugeMetricFamily(
            "diffspec_draft_prefix_cache_cached_entries", "Entries the draft's prefix cache holds",
            value=self.cache.cached_blocks * self.cache.block_tokens,
        )


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
        self._wire = _WireCollector()  # registered at the first watch_wire: only a split gateway has wire traffic

    def serve_http(self, host: str, port: int) -> None:
        """Expose ``/metrics`` on ``host:port`` from a daemon thread."""
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as bad:
            raise InvalidRequest(f"cannot listen on {host}:{port} for metrics: {bad.strerror or bad}") from None

    def watch_target(self, target: WatchedTarget) -> None:
        """Read KV pool and session counts from the target at every scrape."""
        pool = target.pool
        self.kv_pages.labels("total").set_function(lambda: pool.num_pages)
        self.kv_pages.labels("free").set_function(lambda: pool.num_free_pages)
        self.kv_pages.labels("used").set_function(lambda: pool.num_used_pages)
        self.sessions.labels("target").set_function(lambda: len(target.sessions))

    def watch_draft(self, draft: WatchedDraft) -> None:
        self.sessions.labels("draft").set_function(lambda: len(draft.sessions))
        if draft.prefix_cache is not None:
            self.registry.register(_PrefixCacheCollector(draft.prefix_cache))

    def watch_wire(self, peer: str, traffic: WireTraffic) -> None:
        """Export a gRPC client's ``Step`` stream traffic as ``diffspec_wire_{steps,bytes}_total{peer=...}``."""
        if not self._wire.peers:
            self.registry.register(self._wire)
        self._wire.peers[peer] = traffic

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
