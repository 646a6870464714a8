"""The queue for asyncio callers: SQLite calls run in a thread, and waiters wake when results arrive.

`QueueService` is also the in-process `WorkSource` a worker's pull loop leases from (the embedded
default); the control plane's `/v1/generate/get_work` and `/finish_work` routes call the same methods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from scalarlm.protocol.generate import (
    FinishWorkRequest,
    FinishWorkResponse,
    GenerateResult,
    GetWorkRequest,
    GetWorkResponse,
    ModelVersion,
    QueueCounts,
)
from scalarlm.queue.store import FINISHED, EnqueuedBatch, RequestQueue, Throughput
from scalarlm.queue.watches import Watch, Watches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSeen:
    """A worker's last get_work request and when it came."""

    request: GetWorkRequest
    at: float


def runs_without_swap(holding: str | None, models: list[ModelVersion]) -> set[str]:
    """The models a worker holding `holding`'s full weights serves without reloading them: that full fine-tune
    alone, or (holding the base) the base and every LoRA model, whose adapters sit on the base weights."""
    if holding is None:
        return set()
    kinds = {m.name: m.kind for m in models}
    if kinds.get(holding) == "full":
        return {holding}
    return {m.name for m in models if m.kind in ("base", "lora")}


class QueueService:
    """Async facade over `RequestQueue`, implementing the `WorkSource` protocol in-process."""

    def __init__(
        self,
        queue: RequestQueue,
        *,
        max_lease_batch: int = 1024,
        idle_wait: float = 0.25,
        recheck_interval: float = 1.0,
        models: Callable[[], list[ModelVersion]] = list,
    ) -> None:
        self.queue = queue
        self.max_lease_batch = max_lease_batch
        self.idle_wait = idle_wait
        # Waiters re-read SQLite at least this often, so results written by another process are seen.
        self.recheck_interval = recheck_interval
        self.models = models
        # What each worker said in its last get_work (load, loaded versions, held weights), for metrics.
        self.workers: dict[str, WorkerSeen] = {}
        self._watches = Watches()
        self._work_added = asyncio.Event()

    # ---- producers -------------------------------------------------------------------------------

    async def enqueue(self, items: Iterable[dict[str, Any]], model: str) -> EnqueuedBatch:
        """Store a batch in one transaction (in a thread) and wake idle workers."""
        batch = await asyncio.to_thread(self.queue.enqueue, items, model)
        self._pulse("_work_added")
        return batch

    # ---- WorkSource ------------------------------------------------------------------------------

    async def get_work(self, request: GetWorkRequest) -> GetWorkResponse:
        """Lease up to the worker's capacity; when idle, wait briefly for new work before answering."""
        capacity = min(request.capacity, self.max_lease_batch)
        if request.batch_size is not None and request.capacity == 0:
            capacity = min(request.batch_size, self.max_lease_batch)  # ScalarLM worker field name
        models = self.models()
        self.workers[request.worker_id] = WorkerSeen(request, time.time())
        prefer = runs_without_swap(request.holding, models)
        items = await asyncio.to_thread(self.queue.lease, capacity, request.worker_id, None, prefer)
        if not items and capacity > 0 and self.idle_wait > 0:
            await self._wait_event("_work_added", self.idle_wait)
            # Versions published during the wait: the items leased now must be served with them.
            models = self.models()
            prefer = runs_without_swap(request.holding, models)
            items = await asyncio.to_thread(self.queue.lease, capacity, request.worker_id, None, prefer)
        return GetWorkResponse(requests=items, lease_seconds=self.queue.lease_seconds, models=models)

    async def finish_work(self, request: FinishWorkRequest) -> FinishWorkResponse:
        """Store results (first per request id wins) and wake everyone waiting for results."""
        accepted, duplicates = await asyncio.to_thread(self.queue.complete, request.results)
        self._watches.posted([result.request_id for result in request.results])
        return FinishWorkResponse(accepted=accepted, duplicates=duplicates)

    # ---- readers ---------------------------------------------------------------------------------

    async def get(self, request_ids: Sequence[str]) -> list[GenerateResult]:
        """Current results for these ids (NotFound for an unknown one)."""
        return await asyncio.to_thread(self.queue.get, request_ids)

    async def wait_results(self, request_ids: Sequence[str], timeout: float) -> list[GenerateResult]:
        """Long-poll: return once every id is finished or `timeout` seconds have passed."""
        deadline = time.monotonic() + timeout
        with self._watches.watching(Watch(ids=frozenset(request_ids))) as watch:
            results = await self.get(request_ids)  # raises NotFound up front
            pending = {r.request_id for r in results if r.status not in FINISHED}
            if not pending:
                return results
            pending -= watch.take()
            while pending and await self._wake(watch, deadline):
                if not watch.woken.is_set():  # the periodic re-read: finished by another process?
                    pending = set(await asyncio.to_thread(self.queue.unfinished, list(pending)))
                pending -= watch.take()
        return await self.get(request_ids)

    async def wait_batch(self, batch_id: str, timeout: float) -> tuple[int, int]:
        """Long-poll a batch: (total, finished) once it is complete or after `timeout` seconds. Its rows are
        re-counted only when the results posted since the last count could complete it, periodically, and last."""
        deadline = time.monotonic() + timeout
        with self._watches.watching(Watch(batch=batch_id)) as watch:
            total, finished = await asyncio.to_thread(self.queue.batch_counts, batch_id)  # NotFound up front
            posted = 0  # results of this batch stored since the count began: at most this many more are finished
            while finished < total:
                posted += len(watch.take())
                if finished + posted < total and await self._wake(watch, deadline) and watch.woken.is_set():
                    continue  # results came, too few to complete the batch
                posted = 0
                total, finished = await asyncio.to_thread(self.queue.batch_counts, batch_id)
                if time.monotonic() >= deadline:
                    break
        return total, finished

    async def counts(self) -> QueueCounts:
        """Items per state."""
        return await asyncio.to_thread(self.queue.counts)

    async def throughput(self, window_seconds: float) -> Throughput:
        """Items and tokens finished in the recent window."""
        return await asyncio.to_thread(self.queue.throughput, window_seconds)

    async def totals(self) -> tuple[int, int]:
        """(completed items, generated tokens) over everything stored."""
        return await asyncio.to_thread(self.queue.totals)

    async def clear(self) -> int:
        """Fail every queued and leased item as cleared and wake everyone waiting for them; how many."""
        cleared = await asyncio.to_thread(self.queue.clear)
        self._watches.posted(cleared)
        return len(cleared)

    async def requeue_all_leased(self) -> int:
        """Return leases held by a dead in-process worker to the queue."""
        return await asyncio.to_thread(self.queue.requeue_all_leased)

    async def housekeeping(self, retention_seconds: float, interval: float) -> None:
        """Run until cancelled: every `interval`, return expired leases and delete results older
        than `retention_seconds` (so counts stay true without a worker polling, and the file bounded)."""
        while True:
            await asyncio.sleep(interval)
            expired = await asyncio.to_thread(self.queue.expire_leases)
            purged = await asyncio.to_thread(self.queue.purge_finished, time.time() - retention_seconds)
            if expired:
                self._pulse("_work_added")
            if purged:
                logger.info("deleted %d results older than %.0f s", purged, retention_seconds)

    def close(self) -> None:
        """Close the SQLite connection."""
        self.queue.close()

    # ---- waiting ---------------------------------------------------------------------------------

    async def _wake(self, watch: Watch, deadline: float) -> bool:
        """Wait until results for `watch` are posted or `recheck_interval` passes; False once `deadline` has."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        await self._wait_for(watch.woken, min(remaining, self.recheck_interval))
        return True

    async def _wait_event(self, name: str, timeout: float) -> None:
        await self._wait_for(getattr(self, name), timeout)

    @staticmethod
    async def _wait_for(event: asyncio.Event, timeout: float) -> None:
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass

    def _pulse(self, name: str) -> None:
        """Wake current waiters on one event and give later waiters a fresh one."""
        event: asyncio.Event = getattr(self, name)
        setattr(self, name, asyncio.Event())
        event.set()
