"""The durable request queue: one SQLite row per prompt, WAL mode, safe across threads and processes.

A batch is inserted in one transaction; workers lease items FIFO, one model per lease, with a
deadline; results are keyed by request id so the first result wins and a retried item still yields
exactly one. Nothing lives only in memory: reopening the file after a crash restores every item.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalarlm.protocol.errors import InvalidRequest, NotFound
from scalarlm.protocol.generate import GenerateResult, QueueCounts, WorkItem, WorkResult

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    request_id     TEXT PRIMARY KEY,
    batch_id       TEXT NOT NULL,
    idx            INTEGER NOT NULL,
    model          TEXT NOT NULL,
    payload        TEXT NOT NULL,
    state          TEXT NOT NULL DEFAULT 'queued',
    lease_deadline REAL,
    worker_id      TEXT,
    attempts       INTEGER NOT NULL DEFAULT 0,
    result         TEXT,
    error          TEXT,
    tokens         INTEGER,
    created        REAL NOT NULL,
    finished       REAL
);
CREATE INDEX IF NOT EXISTS items_state_model ON items (state, model);
CREATE INDEX IF NOT EXISTS items_state ON items (state);
CREATE INDEX IF NOT EXISTS items_batch ON items (batch_id, state);
CREATE INDEX IF NOT EXISTS items_finished ON items (finished) WHERE finished IS NOT NULL;
"""

FINISHED = ("completed", "failed")
# The error of an item that clear_queue took out of the queue before a worker finished it.
CLEARED = "cleared from the queue (clear_queue) before a worker finished it"
# How long the oldest queued item may wait while workers keep to the weights they hold (then FIFO wins).
AFFINITY_SECONDS = 5.0
# SQLite's bound-parameter limit is large in 3.40, but small chunks keep statements cheap to plan.
_IN_CHUNK = 500


@dataclass(frozen=True)
class EnqueuedBatch:
    """What `enqueue` stored: the batch id and how many items it holds."""

    batch_id: str
    count: int

    @property
    def request_ids(self) -> list[str]:
        """Every request id of the batch, in prompt order."""
        return [request_id_for(self.batch_id, i) for i in range(self.count)]


@dataclass(frozen=True)
class BatchProgress:
    """How far one batch has got: its size, finished items, and the results stored so far."""

    batch_id: str
    total: int
    finished: int
    results: dict[str, GenerateResult]


@dataclass(frozen=True)
class Throughput:
    """Items and generated tokens finished within a recent window, and the span they cover."""

    requests: int
    tokens: int
    seconds: float


class _PayloadEncoder:
    """An item's stored payload: its JSON without `model`. A batch's text items share one sampling dict (the batch
    builder validates a row's settings once), so that part is encoded once and each row adds only its prompt: the
    same text `json.dumps(body, separators=(",", ":"))` gives, at a fraction of the cost for a 1M-prompt upload."""

    def __init__(self) -> None:
        self._sampling: Any = None
        self._sampling_json = ""

    def __call__(self, item: dict[str, Any]) -> str:
        prompt, sampling = item.get("prompt"), item.get("sampling")
        if isinstance(prompt, str) and isinstance(sampling, dict) and list(item) in _TEXT_ITEM_KEYS:
            if sampling is not self._sampling:
                self._sampling, self._sampling_json = sampling, json.dumps(sampling, separators=(",", ":"))
            return f'{{"prompt":{encode_basestring_ascii(prompt)},"sampling":{self._sampling_json}}}'
        return json.dumps({k: v for k, v in item.items() if k != "model"}, separators=(",", ":"))


_TEXT_ITEM_KEYS = (["prompt", "sampling"], ["prompt", "sampling", "model"])


def request_id_for(batch_id: str, idx: int) -> str:
    """ScalarLM's request id shape: `<batch_id>_<idx:09d>`."""
    return f"{batch_id}_{idx:09d}"


def batch_of(request_id: str) -> str:
    """The batch id a request id (`request_id_for`) belongs to."""
    return request_id.rsplit("_", 1)[0]


def new_batch_id() -> str:
    """A random hex batch id (no underscore, so ids split cleanly on the last `_`)."""
    return secrets.token_hex(16)


class RequestQueue:
    """Durable FIFO of prompts in one SQLite file; every public method is one transaction."""

    def __init__(self, path: str | Path, lease_seconds: float = 300.0) -> None:
        self.path = Path(path)
        self.lease_seconds = lease_seconds
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Writes go through one connection shared by threads, serialised by a lock; other processes
        # are kept out by SQLite's own locking (BEGIN IMMEDIATE + busy timeout). Reads use one
        # connection per thread: in WAL mode they never wait for a writer (a 200k-prompt insert
        # does not stall result polling).
        self._conn = self._connect()
        self._lock = threading.Lock()
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.executescript(_SCHEMA)
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()  # not the write lock: readers never wait for writers

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=30000")
        return conn

    def _reader(self) -> sqlite3.Connection:
        """This thread's read connection (opened on first use)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    def close(self) -> None:
        """Close every connection (the file keeps everything)."""
        with self._readers_lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()
        with self._lock:
            self._conn.close()

    # ---- writing -------------------------------------------------------------------------------

    def enqueue(self, items: Iterable[dict[str, Any]], model: str) -> EnqueuedBatch:
        """Store a whole batch in one transaction; `items` may be a generator (read once, lazily).

        Each item is the payload to hand a worker (`prompt` or `messages`, and `sampling`); an item
        may carry its own `model` key, which overrides `model` for that row. An exception raised
        while iterating `items` rolls the whole batch back.
        """
        batch_id = new_batch_id()
        now = time.time()
        counter = _Counter()

        encode = _PayloadEncoder()

        def rows() -> Iterator[tuple[str, str, int, str, str, float]]:
            for idx, item in enumerate(items):
                counter.count = idx + 1
                yield request_id_for(batch_id, idx), batch_id, idx, item.get("model") or model, encode(item), now

        with self._transaction() as cur:
            cur.executemany(
                "INSERT INTO items (request_id, batch_id, idx, model, payload, created) VALUES (?,?,?,?,?,?)",
                rows(),
            )
            if counter.count == 0:
                raise InvalidRequest("prompts must not be empty: a batch needs at least one prompt", param="prompts")
        logger.info("enqueued batch %s: %d items for %s", batch_id, counter.count, model)
        return EnqueuedBatch(batch_id, counter.count)

    def lease(self, capacity: int, worker_id: str, now: float | None = None, prefer: Collection[str] = (),
              affinity_seconds: float = AFFINITY_SECONDS) -> list[WorkItem]:
        """Lease up to `capacity` queued items of one model, FIFO within it, with a deadline.

        The model is the oldest queued item's, unless the worker can run another queued model without swapping
        weights (`prefer`: what it holds) and the oldest item has waited less than `affinity_seconds`: then the
        oldest item of a preferred model. So with several full-weight models and workers, each worker keeps to the
        weights it holds and swaps are spread, while no model waits longer than `affinity_seconds` for a swap.
        """
        if capacity <= 0:
            return []
        now = time.time() if now is None else now
        if not self._has_leasable(now):
            return []  # the common idle poll: a read, no write lock
        with self._transaction() as cur:
            self._expire(cur, now)
            oldest = cur.execute(
                "SELECT model, created FROM items WHERE state='queued' ORDER BY rowid LIMIT 1"
            ).fetchone()
            if oldest is None:
                return []
            model = oldest[0]
            if prefer and model not in prefer and now - oldest[1] < affinity_seconds:
                model = self._oldest_of(cur, list(prefer)) or model
            rows = cur.execute(
                "SELECT rowid, request_id, model, payload FROM items WHERE state='queued' AND model=? "
                "ORDER BY rowid LIMIT ?",
                (model, capacity),
            ).fetchall()
            cur.executemany(
                "UPDATE items SET state='leased', lease_deadline=?, worker_id=?, attempts=attempts+1 "
                "WHERE rowid=?",
                ((now + self.lease_seconds, worker_id, row[0]) for row in rows),
            )
        return [_work_item(request_id, model, payload) for _, request_id, model, payload in rows]

    def complete(self, results: Sequence[WorkResult], now: float | None = None) -> tuple[int, int]:
        """Store results; the first result per request id wins. Returns (accepted, duplicates)."""
        now = time.time() if now is None else now
        accepted = 0
        with self._transaction() as cur:
            for result in results:
                state, body, tokens = _finished_row(result)
                cur.execute(
                    "UPDATE items SET state=?, result=?, error=?, tokens=?, finished=?, lease_deadline=NULL "
                    "WHERE request_id=? AND state IN ('queued', 'leased')",
                    (state, body, result.error, tokens, now, result.request_id),
                )
                accepted += cur.rowcount
        duplicates = len(results) - accepted
        if duplicates:
            logger.info("ignored %d duplicate or unknown results", duplicates)
        return accepted, duplicates

    def requeue_all_leased(self) -> int:
        """Return every leased item to the queue (the workers holding them died with this process)."""
        with self._transaction() as cur:
            cur.execute("UPDATE items SET state='queued', lease_deadline=NULL, worker_id=NULL WHERE state='leased'")
            count = cur.rowcount
        if count:
            logger.info("requeued %d leased items left by a previous process", count)
        return count

    def expire_leases(self, now: float | None = None) -> int:
        """Return items whose lease deadline has passed to the queue; returns how many."""
        with self._transaction() as cur:
            return self._expire(cur, time.time() if now is None else now)

    def clear(self, now: float | None = None) -> list[str]:
        """Fail every queued and leased item with CLEARED (ScalarLM's clear_queue); their request ids. No worker takes
        them and a late result for one is ignored; a client reading them gets that error beside its finished results
        (deleted, they made a whole get_results 404), and housekeeping purges them with the other finished items."""
        with self._transaction() as cur:
            cur.execute(
                "UPDATE items SET state='failed', result=NULL, error=?, tokens=NULL, finished=?, lease_deadline=NULL "
                "WHERE state IN ('queued', 'leased') RETURNING request_id",
                (CLEARED, time.time() if now is None else now),
            )
            return [row[0] for row in cur.fetchall()]

    def purge_finished(self, older_than: float) -> int:
        """Delete finished items whose results were stored before the `older_than` timestamp."""
        with self._transaction() as cur:
            cur.execute("DELETE FROM items WHERE finished IS NOT NULL AND finished < ?", (older_than,))
            return cur.rowcount

    # ---- reading -------------------------------------------------------------------------------

    def get(self, request_ids: Sequence[str]) -> list[GenerateResult]:
        """Results (finished or not) in the order asked; an unknown id raises NotFound naming it."""
        found: dict[str, GenerateResult] = {}
        conn = self._reader()
        for start in range(0, len(request_ids), _IN_CHUNK):
            chunk = list(request_ids[start : start + _IN_CHUNK])
            marks = ",".join("?" * len(chunk))
            for row in conn.execute(
                f"SELECT request_id, model, state, result, error FROM items WHERE request_id IN ({marks})", chunk
            ):
                found[row[0]] = _result(*row)
        for request_id in request_ids:
            if request_id not in found:
                raise NotFound(f"unknown request id {request_id!r}", param="request_ids")
        return [found[request_id] for request_id in request_ids]

    def unfinished(self, request_ids: Sequence[str]) -> list[str]:
        """Those of these request ids whose items are still queued or leased."""
        conn = self._reader()
        pending: list[str] = []
        for start in range(0, len(request_ids), _IN_CHUNK):
            chunk = list(request_ids[start : start + _IN_CHUNK])
            marks = ",".join("?" * len(chunk))
            pending.extend(row[0] for row in conn.execute(
                f"SELECT request_id FROM items WHERE request_id IN ({marks}) AND +state IN ('queued','leased')", chunk
            ))  # fmt: skip
        return pending

    def batch_counts(self, batch_id: str) -> tuple[int, int]:
        """(total, finished) items of one batch; NotFound for an unknown batch id."""
        rows = self._reader().execute(
            "SELECT state, COUNT(*) FROM items WHERE batch_id=? GROUP BY state", (batch_id,)
        ).fetchall()
        if not rows:
            raise NotFound(f"unknown batch id {batch_id!r}", param="request_id")
        by_state = dict(rows)
        return sum(by_state.values()), sum(by_state.get(s, 0) for s in FINISHED)

    def batch_progress(self, batch_id: str) -> BatchProgress:
        """A batch's size, finished count and every result so far (unfinished ones have no response)."""
        rows = self._reader().execute(
            "SELECT request_id, model, state, result, error FROM items WHERE batch_id=? ORDER BY idx",
            (batch_id,),
        ).fetchall()
        if not rows:
            raise NotFound(f"unknown batch id {batch_id!r}", param="request_id")
        results = {row[0]: _result(*row) for row in rows}
        finished = sum(1 for row in rows if row[2] in FINISHED)
        return BatchProgress(batch_id, len(rows), finished, results)

    def finished_page(self, batch_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` finished results of a batch, in prompt order, with request id above `after`,
        as plain `GenerateResult` dicts: a 200k-item download streams page by page, never all in
        memory. Request ids sort in prompt order, so this is a range scan of the primary key."""
        low = after if after is not None else f"{batch_id}_"
        # '+state' keeps SQLite on the primary key (a range scan) instead of the state index + a sort.
        rows = self._reader().execute(
            "SELECT request_id, model, state, result, error FROM items "
            "WHERE request_id > ? AND request_id < ? AND +state IN ('completed','failed') "
            "ORDER BY request_id LIMIT ?",
            (low, f"{batch_id}`", limit),  # '`' sorts right after '_'
        ).fetchall()
        return [result_fields(*row) for row in rows]

    def counts(self) -> QueueCounts:
        """Items per state."""
        rows = self._reader().execute("SELECT state, COUNT(*) FROM items GROUP BY state").fetchall()
        return QueueCounts(**dict(rows))

    def throughput(self, window_seconds: float, now: float | None = None) -> Throughput:
        """Items and generated tokens finished in the last `window_seconds` (for requests/s, tokens/s)."""
        now = time.time() if now is None else now
        count, tokens, first = self._reader().execute(
            "SELECT COUNT(*), COALESCE(SUM(tokens), 0), MIN(finished) FROM items "
            "WHERE finished IS NOT NULL AND finished >= ? AND error IS NOT ?",  # cleared items were not served
            (now - window_seconds, CLEARED),
        ).fetchone()
        seconds = max(now - first, 1.0) if first is not None else window_seconds
        return Throughput(count, tokens, seconds)

    def totals(self) -> tuple[int, int]:
        """(completed items, generated tokens) over everything still stored."""
        count, tokens = self._reader().execute(
            "SELECT COUNT(*), COALESCE(SUM(tokens), 0) FROM items WHERE state='completed'"
        ).fetchone()
        return count, tokens

    # ---- internals -----------------------------------------------------------------------------

    @staticmethod
    def _oldest_of(cur: sqlite3.Cursor, models: list[str]) -> str | None:
        """The model of the oldest queued item among `models` (None when none of them has queued work)."""
        best: tuple[int, str] | None = None
        for i in range(0, len(models), _IN_CHUNK):
            chunk = models[i : i + _IN_CHUNK]
            row = cur.execute(
                f"SELECT min(rowid), model FROM items WHERE state='queued' AND model IN ({','.join('?' * len(chunk))})",
                chunk,
            ).fetchone()
            if row is not None and row[0] is not None and (best is None or row[0] < best[0]):
                best = (row[0], row[1])
        return best[1] if best is not None else None

    def _has_leasable(self, now: float) -> bool:
        row = self._reader().execute(
            "SELECT EXISTS(SELECT 1 FROM items WHERE state='queued') "
            "OR EXISTS(SELECT 1 FROM items WHERE state='leased' AND lease_deadline < ?)",
            (now,),
        ).fetchone()
        return bool(row[0])

    def _expire(self, cur: sqlite3.Cursor, now: float) -> int:
        cur.execute(
            "UPDATE items SET state='queued', lease_deadline=NULL, worker_id=NULL "
            "WHERE state='leased' AND lease_deadline < ?",
            (now,),
        )
        if cur.rowcount:
            logger.warning("%d leases expired; items returned to the queue", cur.rowcount)
        return cur.rowcount

    def _transaction(self) -> "_Transaction":
        return _Transaction(self._conn, self._lock)


class _Counter:
    count = 0


class _Transaction:
    """`BEGIN IMMEDIATE` under the connection lock; commit on success, roll back on any error."""

    def __init__(self, conn: sqlite3.Connection, lock: threading.Lock) -> None:
        self.conn = conn
        self.lock = lock

    def __enter__(self) -> sqlite3.Cursor:
        self.lock.acquire()
        try:
            self.cur = self.conn.cursor()
            self.cur.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.cur

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.cur.execute("COMMIT" if exc_type is None else "ROLLBACK")
        finally:
            self.lock.release()


def _work_item(request_id: str, model: str, payload: str) -> WorkItem:
    data = json.loads(payload)
    return WorkItem(
        request_id=request_id,
        model=model,
        prompt=data.get("prompt"),
        messages=data.get("messages"),
        tools=data.get("tools"),
        sampling=data.get("sampling") or {},
    )


def _finished_row(result: WorkResult) -> tuple[str, str, int]:
    """The state, stored JSON and generated-token count for one worker result."""
    outputs = result.outputs or []
    tokens = sum(len(o.token_ids) for o in outputs)
    body = {
        "model": result.model,
        "version": result.version,
        "prompt_tokens": result.prompt_tokens,
        "outputs": [o.model_dump(exclude_defaults=True) for o in outputs],
    }
    state = "failed" if result.error is not None or not outputs else "completed"
    return state, json.dumps(body, separators=(",", ":")), tokens


def result_fields(request_id: str, model: str, state: str, result: str | None, error: str | None) -> dict[str, Any]:
    """One row as the plain dict of a `GenerateResult` (same keys, same order), without pydantic."""
    body = json.loads(result) if result is not None else {}
    outputs = body.get("outputs")
    first = outputs[0] if outputs else {}
    if state == "failed" and error is None:
        error = "the worker returned no output"
    return {
        "request_id": request_id,
        "response": first.get("text") if state == "completed" else None,
        "error": error,
        "status": state,
        "model": body.get("model") or model,
        "version": body.get("version"),
        "finish_reason": first.get("finish_reason"),
        "prompt_tokens": body.get("prompt_tokens"),
        "completion_tokens": sum(len(o.get("token_ids", ())) for o in outputs) if outputs is not None else None,
        "logprobs": first.get("logprobs"),
        "outputs": outputs,
    }


def _result(request_id: str, model: str, state: str, result: str | None, error: str | None) -> GenerateResult:
    """Build the wire result for one row."""
    return GenerateResult.model_validate(result_fields(request_id, model, state, result, error))
