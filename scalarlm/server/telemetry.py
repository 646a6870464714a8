"""Prometheus metrics of one app, in its own registry (no globals), emitted from this one place.

Queue depth, throughput and engine load are read at scrape time; HTTP requests are counted by a
small ASGI middleware, labelled by route template (not raw path) so cardinality stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scalarlm.protocol.generate import EngineLoad
from scalarlm.queue import RequestQueue

THROUGHPUT_WINDOW_SECONDS = 60.0


class _LiveCollector(Collector):
    """Reads the queue and the engine load when Prometheus scrapes."""

    def __init__(self) -> None:
        self.queue: RequestQueue | None = None
        self.load: Callable[[], EngineLoad] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.queue is not None:
            depth = GaugeMetricFamily("scalarlm_queue_items", "Batch items in the queue by state", labels=["state"])
            for state, count in self.queue.counts().model_dump().items():
                depth.add_metric([state], count)
            yield depth
            recent = self.queue.throughput(THROUGHPUT_WINDOW_SECONDS)
            yield GaugeMetricFamily(
                "scalarlm_requests_per_second", "Batch items finished per second (last minute)",
                value=recent.requests / recent.seconds,
            )
            yield GaugeMetricFamily(
                "scalarlm_tokens_per_second", "Tokens generated per second for batch items (last minute)",
                value=recent.tokens / recent.seconds,
            )
        if self.load is not None:
            load = self.load()
            yield GaugeMetricFamily("scalarlm_engine_running", "Sequences running in the engine", value=load.running)
            yield GaugeMetricFamily("scalarlm_engine_waiting", "Sequences waiting in the engine", value=load.waiting)
            yield GaugeMetricFamily("scalarlm_engine_max_num_seqs", "Engine sequence slots", value=load.max_num_seqs)
            yield GaugeMetricFamily(
                "scalarlm_engine_kv_cache_usage", "Fraction of the KV cache in use", value=load.kv_cache_usage
            )


class ServerMetrics:
    """The app's registry: live gauges plus an HTTP request counter."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.live = _LiveCollector()
        self.registry.register(self.live)
        self.http_requests = Counter(
            "scalarlm_http_requests", "HTTP requests answered", ["route", "method", "status"], registry=self.registry
        )

    def bind(self, queue: RequestQueue | None, load: Callable[[], EngineLoad] | None) -> None:
        """Point the live gauges at the queue and the engine (done once the lifespan has opened them)."""
        self.live.queue = queue
        self.live.load = load

    def render(self) -> bytes:
        """The Prometheus text exposition (reads SQLite: call it from a thread)."""
        return generate_latest(self.registry)


class HttpMetricsMiddleware:
    """Counts every answered request by route template, method and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.http_requests.labels(path, scope.get("method", ""), str(status)).inc()
