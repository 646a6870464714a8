"""Prometheus metrics of one app, in its own registry (no globals), emitted from this one place.

Queue depth, throughput and engine load are read at scrape time; HTTP requests are counted by a
small ASGI middleware, labelled by route template (not raw path) so cardinality stays bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scalarlm.protocol.generate import EngineLoad
from scalarlm.queue import RequestQueue
from scalarlm.queue.service import WorkerSeen

THROUGHPUT_WINDOW_SECONDS = 60.0


class _LiveCollector(Collector):
    """Reads the queue, the engine load and what each worker last reported when Prometheus scrapes."""

    def __init__(self) -> None:
        self.queue: RequestQueue | None = None
        self.load: Callable[[], EngineLoad] | None = None
        self.workers: Mapping[str, WorkerSeen] = {}
        self.http_in_flight: Callable[[], int] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.http_in_flight is not None:
            yield GaugeMetricFamily("scalarlm_http_requests_in_flight", "HTTP requests being answered (this scrape "
                                    "included)", value=self.http_in_flight())  # fmt: skip
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
        yield from worker_metrics(dict(self.workers), time.time())


# name -> (help, EngineLoad field): one gauge per worker, from the load it sent with its last get_work.
_WORKER_GAUGES = {
    "scalarlm_worker_running": ("Sequences running in the worker's engine", "running"),
    "scalarlm_worker_waiting": ("Sequences waiting in the worker's engine", "waiting"),
    "scalarlm_worker_max_num_seqs": ("The worker engine's sequence slots", "max_num_seqs"),
    "scalarlm_worker_kv_cache_usage": ("Fraction of the worker's KV cache in use", "kv_cache_usage"),
    "scalarlm_worker_swaps": ("Full-weight swaps the worker has done since it started", "swaps"),
    "scalarlm_worker_swap_seconds": ("Seconds the worker has spent swapping full weights", "swap_seconds"),
}
WORKER_FORGET_SECONDS = 600.0  # a worker not heard from for this long drops out of the metrics


def worker_metrics(workers: dict[str, WorkerSeen], now: float) -> Iterator[GaugeMetricFamily]:
    """Per-worker gauges (labelled by worker id) from each worker's last get_work."""
    live = {w: seen for w, seen in workers.items() if now - seen.at < WORKER_FORGET_SECONDS}
    age = GaugeMetricFamily("scalarlm_worker_last_seen_seconds", "Seconds since the worker last asked for work",
                            labels=["worker"])  # fmt: skip
    versions = GaugeMetricFamily("scalarlm_worker_model_version", "Weights version of each model the worker has "
                                 "loaded", labels=["worker", "model"])  # fmt: skip
    holding = GaugeMetricFamily("scalarlm_worker_holding", "1 for the model whose full weights the worker's engine "
                                "holds", labels=["worker", "model"])  # fmt: skip
    gauges = {name: GaugeMetricFamily(name, text, labels=["worker"]) for name, (text, _) in _WORKER_GAUGES.items()}
    for worker, seen in sorted(live.items()):
        age.add_metric([worker], now - seen.at)
        for model, version in seen.request.loaded.items():
            versions.add_metric([worker, model], version)
        if seen.request.holding is not None:
            holding.add_metric([worker, seen.request.holding], 1)
        if seen.request.load is not None:
            for name, (_, attr) in _WORKER_GAUGES.items():
                gauges[name].add_metric([worker], getattr(seen.request.load, attr))
    yield from (age, versions, holding, *gauges.values())


class ServerMetrics:
    """The app's registry: live gauges plus an HTTP request counter."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.live = _LiveCollector()
        self.registry.register(self.live)
        self.http_requests = Counter(
            "scalarlm_http_requests", "HTTP requests answered", ["route", "method", "status"], registry=self.registry
        )

    def bind(self, queue: RequestQueue | None, load: Callable[[], EngineLoad] | None,
             workers: Mapping[str, WorkerSeen] | None = None) -> None:
        """Point the live gauges at the queue, the engine and the workers' reports (once the lifespan opened them)."""
        self.live.queue = queue
        self.live.load = load
        self.live.workers = workers if workers is not None else {}

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
