"""Per-key limits: unfinished batch items (`max_queued`) and running training jobs (`max_jobs`).

A key over its limit is answered 429 with `Retry-After`. The counts are derived from the queue and the
job directories (the durable record); which batches and jobs belong to which key is held in memory
only, so a restarted control plane starts every key's count from zero.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from scalarlm.protocol.errors import InvalidRequest, NotFound, QueueFull
from scalarlm.queue import QueueService
from scalarlm.server.auth import ApiKey

RETRY_AFTER_SECONDS = 5.0


@dataclass
class KeyUsage:
    """Batches and jobs submitted with each key, by key digest."""

    batches: dict[bytes, set[str]] = field(default_factory=dict)
    jobs: dict[bytes, set[str]] = field(default_factory=dict)

    async def check_queued(self, key: ApiKey | None, adding: int, queue: QueueService) -> None:
        """Raise QueueFull when `adding` more items would pass the key's `max_queued`."""
        if key is None or key.max_queued is None:
            return
        if adding > key.max_queued:
            raise InvalidRequest(
                f"{adding} prompts is more than this key may have queued ({key.max_queued})", param="prompts"
            )
        pending = await asyncio.to_thread(self._pending, key, queue)
        if pending + max(adding, 1) > key.max_queued:
            raise QueueFull(
                f"this key has {pending} unfinished items; its limit is {key.max_queued}",
                retry_after=RETRY_AFTER_SECONDS,
            )

    def add_batch(self, key: ApiKey | None, batch_id: str) -> None:
        """Count a stored batch against its key."""
        if key is not None and key.max_queued is not None:
            self.batches.setdefault(key.digest, set()).add(batch_id)

    def _pending(self, key: ApiKey, queue: QueueService) -> int:
        pending = 0
        batches = self.batches.get(key.digest, set())
        for batch_id in list(batches):
            try:
                total, finished = queue.queue.batch_counts(batch_id)
            except NotFound:
                total = finished = 0
            if finished >= total:
                batches.discard(batch_id)  # done (or cleared): no longer counts
            pending += total - finished
        return pending

    def check_jobs(self, key: ApiKey | None, is_running: Callable[[str], bool]) -> None:
        """Raise QueueFull when the key already runs `max_jobs` training jobs."""
        if key is None or key.max_jobs is None:
            return
        running = {job_id for job_id in self.jobs.get(key.digest, set()) if is_running(job_id)}
        self.jobs[key.digest] = running
        if len(running) >= key.max_jobs:
            raise QueueFull(
                f"this key runs {len(running)} training jobs; its limit is {key.max_jobs}",
                retry_after=RETRY_AFTER_SECONDS,
            )

    def add_job(self, key: ApiKey | None, job_id: str) -> None:
        """Count a submitted job against its key."""
        if key is not None and key.max_jobs is not None:
            self.jobs.setdefault(key.digest, set()).add(job_id)



def request_key(request: Request) -> ApiKey | None:
    """The API key the request was authenticated with (None when keys are off)."""
    return getattr(request.state, "api_key", None)


def request_usage(request: Request) -> KeyUsage:
    """The app's per-key usage record."""
    return request.app.state.usage
