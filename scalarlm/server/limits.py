"""Per-key limits: unfinished batch items (`max_queued`) and running training jobs (`max_jobs`).

A key over its limit is answered 429 with `Retry-After`. The counts are derived from the queue and the
job directories (the durable record); which batches and jobs belong to which key is kept in SQLite beside the
queue (`$SCALARLM_HOME/usage.sqlite`, key digests only), so a restarted control plane keeps counting them.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from scalarlm.protocol.errors import InvalidRequest, NotFound, QueueFull
from scalarlm.queue import QueueService
from scalarlm.server.auth import ApiKey

RETRY_AFTER_SECONDS = 5.0


class OwnershipStore:
    """Which key (by digest) submitted which batch or job, on disk: one row per (kind, ref)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS owned (kind TEXT NOT NULL, ref TEXT NOT NULL, "
                         "key BLOB NOT NULL, PRIMARY KEY (kind, ref))")  # fmt: skip
        self._lock = threading.Lock()

    def load(self, kind: str) -> dict[bytes, set[str]]:
        with self._lock:
            rows = self._db.execute("SELECT key, ref FROM owned WHERE kind = ?", (kind,)).fetchall()
        owned: dict[bytes, set[str]] = {}
        for key, ref in rows:
            owned.setdefault(bytes(key), set()).add(ref)
        return owned

    def add(self, kind: str, key: bytes, ref: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO owned (kind, ref, key) VALUES (?, ?, ?)", (kind, ref, key))

    def discard(self, kind: str, refs: set[str]) -> None:
        if refs:
            with self._lock:
                self._db.executemany("DELETE FROM owned WHERE kind = ? AND ref = ?", [(kind, r) for r in refs])


@dataclass
class KeyUsage:
    """Batches and jobs submitted with each key, by key digest (kept in `store` when given)."""

    store: OwnershipStore | None = None
    batches: dict[bytes, set[str]] = field(default_factory=dict)
    jobs: dict[bytes, set[str]] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path) -> "KeyUsage":
        """The usage record kept in `path` (loaded now: counts survive a restart)."""
        store = OwnershipStore(path)
        return cls(store=store, batches=store.load("batch"), jobs=store.load("job"))

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
            if self.store is not None:
                self.store.add("batch", key.digest, batch_id)

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
                if self.store is not None:
                    self.store.discard("batch", {batch_id})
            pending += total - finished
        return pending

    def check_jobs(self, key: ApiKey | None, is_running: Callable[[str], bool]) -> None:
        """Raise QueueFull when the key already runs `max_jobs` training jobs."""
        if key is None or key.max_jobs is None:
            return
        owned = self.jobs.get(key.digest, set())
        running = {job_id for job_id in owned if is_running(job_id)}
        self.jobs[key.digest] = running
        if self.store is not None:
            self.store.discard("job", owned - running)
        if len(running) >= key.max_jobs:
            raise QueueFull(
                f"this key runs {len(running)} training jobs; its limit is {key.max_jobs}",
                retry_after=RETRY_AFTER_SECONDS,
            )

    def add_job(self, key: ApiKey | None, job_id: str) -> None:
        """Count a submitted job against its key."""
        if key is not None and key.max_jobs is not None:
            self.jobs.setdefault(key.digest, set()).add(job_id)
            if self.store is not None:
                self.store.add("job", key.digest, job_id)



def request_key(request: Request) -> ApiKey | None:
    """The API key the request was authenticated with (None when keys are off)."""
    return getattr(request.state, "api_key", None)


def request_usage(request: Request) -> KeyUsage:
    """The app's per-key usage record."""
    return request.app.state.usage


def check_job_limit(request: Request, is_running: Callable[[str], bool]) -> None:
    """Per-key limit on concurrent training jobs (fine-tuning jobs, RL sessions, Tinker training clients alike):
    429 when the request's key already runs its maximum."""
    request_usage(request).check_jobs(request_key(request), is_running)


def count_job(request: Request, job_id: str) -> None:
    """Count a started job against the request's key."""
    request_usage(request).add_job(request_key(request), job_id)
