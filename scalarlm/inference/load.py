"""Engine load: vLLM's scheduler stats (read in this one place) combined with the worker's own count.

vLLM reports `SchedulerStats` after each engine step through a stat logger; between steps the worker
knows better, because it counts the sequences it has submitted and not yet seen finish.
"""

from __future__ import annotations

import logging
from typing import Any

from scalarlm.inference.vllm_api import PrometheusStatLogger, VllmConfig
from scalarlm.protocol.generate import EngineLoad

logger = logging.getLogger(__name__)


class LoadTracker:
    """What the engine is doing now: last scheduler stats plus this worker's in-flight sequences."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len: int | None = None  # set once the engine has started (vLLM may fit it to memory)
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.in_flight = 0
        self.swaps = 0
        self.swap_seconds = 0.0

    def record_scheduler_stats(self, stats: Any) -> None:
        """Copy the (unstable, per vLLM) `SchedulerStats` fields we use; the only reader of them."""
        self.running = int(getattr(stats, "num_running_reqs", 0))
        self.waiting = int(getattr(stats, "num_waiting_reqs", 0)) + int(
            getattr(stats, "num_skipped_waiting_reqs", 0)
        )
        self.kv_cache_usage = min(1.0, max(0.0, float(getattr(stats, "kv_cache_usage", 0.0))))

    def record_swap(self, seconds: float) -> None:
        """Count one full-weight reload that took `seconds`."""
        self.swaps += 1
        self.swap_seconds += seconds

    def add(self, sequences: int) -> None:
        """Count sequences submitted to the engine."""
        self.in_flight += sequences

    def done(self, sequences: int) -> None:
        """Count sequences that finished (or failed)."""
        self.in_flight = max(0, self.in_flight - sequences)

    def snapshot(self) -> EngineLoad:
        """The engine's load as the protocol reports it.

        Every request reaches the engine through this worker, so its in-flight count is the exact total;
        the (slightly stale) stats only split it into running and waiting and give the KV cache use.
        """
        total = self.in_flight
        if total == 0:
            return EngineLoad(max_num_seqs=self.max_num_seqs, swaps=self.swaps, swap_seconds=self.swap_seconds,
                              max_model_len=self.max_model_len)  # fmt: skip
        running = min(self.running, total, self.max_num_seqs)
        return EngineLoad(
            running=running,
            waiting=total - running,
            max_num_seqs=self.max_num_seqs,
            kv_cache_usage=self.kv_cache_usage,
            swaps=self.swaps,
            swap_seconds=self.swap_seconds,
            max_model_len=self.max_model_len,
        )


class SchedulerStatsLogger(PrometheusStatLogger):
    """A vLLM stat logger that forwards each engine step's scheduler stats to a `LoadTracker`.

    It takes the Prometheus logger's place, as vLLM's own `RayPrometheusStatLogger` does: vLLM builds
    a Prometheus logger only when no custom one is given. This worker exposes no vLLM `/metrics` (the
    control plane owns metrics), and Prometheus histograms per token cost ~15% of the front end's CPU.
    """

    tracker: LoadTracker  # bound per engine by `stat_logger_factory`

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
        # Deliberately no super().__init__(): it would register Prometheus metrics we never serve.
        self.vllm_config = vllm_config
        self.engine_indexes = engine_indexes or [0]

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        """Called by vLLM after every engine step."""
        if scheduler_stats is not None:
            self.tracker.record_scheduler_stats(scheduler_stats)

    def record_admission_rejection(self, reason: str) -> None:
        """Admission is the control plane's job; nothing to record."""

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        """Sleep mode is not used by this worker."""

    def log_engine_initialized(self) -> None:
        """Nothing to log: the worker logs its own start."""

    def log(self) -> None:
        """Nothing to log periodically."""


def stat_logger_factory(tracker: LoadTracker) -> type[SchedulerStatsLogger]:
    """A stat logger class (what `AsyncLLM(stat_loggers=[...])` takes) bound to `tracker`."""
    return type("BoundSchedulerStatsLogger", (SchedulerStatsLogger,), {"tracker": tracker})
