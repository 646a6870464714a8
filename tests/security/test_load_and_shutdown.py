"""A real `scalarlm serve` (control plane + in-process vLLM worker on the tiny model) under a burst of
concurrent OpenAI streams and a 20,000-prompt batch, then SIGTERM mid-batch: draining answers 503 with
Retry-After, leased items go back to the queue, the process exits within its bound; a restart is then
SIGKILLed mid-batch, and a second restart on the same home completes every item exactly once."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from scalarlm.inference.reaper import descendants
from scalarlm.launcher.process import is_alive
from security_serve import serve

STREAMS = 500
BATCH = 20_000
SHUTDOWN_SECONDS = 20
# Admission capacity = admit_factor x max_num_seqs = 128: most of the 500 streams are told to come back.
ENV = {"SCALARLM_SERVER__ADMIT_FACTOR": "1", "SCALARLM_MAX_NUM_SEQS": "128",
       "SCALARLM_SERVER__SHUTDOWN_SECONDS": str(SHUTDOWN_SECONDS)}
FIGURES: dict[str, object] = {}


def tree_rss(pid: int) -> int:
    """Resident bytes of the server and its children (vLLM may run helpers)."""
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class RssSampler:
    """Peak RSS of a process tree, sampled every 0.5 s in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, tree_rss(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.peak = max(self.peak, tree_rss(self.pid))
            except psutil.NoSuchProcess:
                return

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("load") / "home"


@pytest.fixture(scope="module")
def engine_server(tiny_model_dir: Path, home: Path) -> Iterator[tuple[str, psutil.Popen]]:
    with serve(["--model", str(tiny_model_dir)], home, ENV, need_engine=True) as (url, proc, _):
        yield url, proc


async def _stream(client: httpx.AsyncClient, model: str, i: int, statuses: Counter, retry_afters: list) -> bool:
    """One streamed chat completion, retried after 429 as told; True when it ended with [DONE]."""
    body = {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 4,
            "stream": True}
    for _ in range(60):
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
                statuses[reply.status_code] += 1
                if reply.status_code == 429:
                    retry_afters.append(reply.headers.get("retry-after"))
                    await reply.aread()
                    await asyncio.sleep(min(float(reply.headers.get("retry-after", "1")), 2.0))
                    continue
                text = (await reply.aread()).decode()
                return reply.status_code == 200 and text.rstrip().endswith("data: [DONE]")
        except httpx.TransportError as e:  # counted and asserted rare below; a dead server fails every retry
            statuses[type(e).__name__] += 1
            await asyncio.sleep(1.0)
    return False


def _queue_states(home: Path) -> dict[str, int]:
    with sqlite3.connect(home / "queue.sqlite") as db:
        return dict(db.execute("SELECT state, COUNT(*) FROM items GROUP BY state").fetchall())


async def _wait_batch_done(client: httpx.AsyncClient, total: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queue = (await client.get("/v1/generate/metrics")).json()["queue"]
        if queue["completed"] + queue["failed"] >= total:
            return queue
        await asyncio.sleep(1.0)
    raise AssertionError(f"batch not done after {timeout} s: {queue}")


@pytest.mark.slow
async def test_burst_of_streams_and_a_big_batch(engine_server, tiny_model_dir: Path) -> None:
    url, proc = engine_server
    model = tiny_model_dir.name
    # No keep-alive: a pooled connection the server closes as idle would race with its reuse.
    limits = httpx.Limits(max_connections=STREAMS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        warm = await client.post("/v1/completions", json={"model": model, "prompt": "warm", "max_tokens": 2})
        assert warm.status_code == 200
        rss_before = tree_rss(proc.pid)
        started = time.monotonic()
        with RssSampler(proc.pid) as sampler:
            prompts = [f"prompt {i}" for i in range(BATCH)]
            batch = await client.post("/v1/generate", json={"prompts": prompts, "max_tokens": 2})
            assert batch.status_code == 200, batch.text
            ids = [r["request_id"] for r in batch.json()["results"]]
            statuses: Counter = Counter()
            retry_afters: list = []
            done = await asyncio.gather(*(_stream(client, model, i, statuses, retry_afters) for i in range(STREAMS)))
            queue = await _wait_batch_done(client, BATCH, timeout=900)
            results = []
            for k in range(0, BATCH, 2000):
                got = await client.post("/v1/generate/get_results", json={"request_ids": ids[k:k + 2000],
                                                                           "wait_seconds": 0})
                results += got.json()["results"]
        elapsed = time.monotonic() - started
        rss_after = tree_rss(proc.pid)
    server_errors = sum(n for code, n in statuses.items() if isinstance(code, int) and code >= 500)
    transport_errors = sum(n for code, n in statuses.items() if isinstance(code, str))
    FIGURES.update(streams=STREAMS, streams_completed=sum(done), stream_statuses=dict(statuses),
                   batch=BATCH, batch_completed=queue["completed"], batch_failed=queue["failed"],
                   seconds=round(elapsed, 1), rss_before_mb=rss_before >> 20, rss_peak_mb=sampler.peak >> 20,
                   rss_after_mb=rss_after >> 20)
    print(f"\nload: {json.dumps(FIGURES)}")
    assert server_errors == 0 and {c for c in statuses if isinstance(c, int)} <= {200, 429}
    assert transport_errors <= STREAMS // 100, statuses  # dropped connections: at most 1%
    assert all(ra is not None and int(ra) >= 1 for ra in retry_afters)  # every 429 says when to retry
    assert all(done), f"{STREAMS - sum(done)} streams did not finish"
    assert queue["completed"] == BATCH and queue["failed"] == 0
    assert len(results) == BATCH and len({r["request_id"] for r in results}) == BATCH
    assert all(r["response"] is not None for r in results)
    # Bounded memory: the burst may not grow the server (engine included) by more than 1 GiB.
    assert sampler.peak - rss_before < 1 << 30, FIGURES


def _in_flight(url: str) -> float:
    """The server's count of HTTP requests being answered, from its Prometheus text."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("scalarlm_http_requests_in_flight "))


def test_sigterm_drains_then_sigkill_and_restart_lose_nothing(engine_server, home: Path, tiny_model_dir: Path) -> None:
    url, proc = engine_server
    # Enough that the drain (the engine finishes what it leased) leaves a good part queued for the SIGKILL phase: on
    # a fast box the drain completed 2,817 of 3,000.
    total = 6000
    batch = httpx.post(f"{url}/v1/generate", json={"prompts": [f"p {i}" for i in range(total)], "max_tokens": 32},
                       timeout=120)
    assert batch.status_code == 200
    ids = [r["request_id"] for r in batch.json()["results"]]
    # A long-poll in flight keeps the server draining for a while.
    holder = threading.Thread(target=lambda: httpx.post(
        f"{url}/v1/generate/get_results", json={"request_ids": ids, "wait_seconds": 10}, timeout=60))
    holder.start()
    # SIGTERM only once the long-poll is being answered (on a busy box it can take a while to be read): with
    # nothing in flight the drain ends at the next tick, before any request could see its 503.
    deadline = time.monotonic() + 60
    while _in_flight(url) < 2 and time.monotonic() < deadline:  # the scrape itself is one
        time.sleep(0.05)
    assert _in_flight(url) >= 2, "the long-poll never reached the server"
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    refused = None
    while time.monotonic() - sent < 5 and proc.poll() is None:
        try:
            reply = httpx.get(f"{url}/v1/generate/metrics", timeout=5)
        except httpx.TransportError:
            break
        if reply.status_code == 503:
            refused = reply
            break
        time.sleep(0.05)
    assert refused is not None, "no 503 while draining"
    assert int(refused.headers["Retry-After"]) >= 1 and "shutting down" in refused.json()["error"]["message"]
    proc.wait(timeout=SHUTDOWN_SECONDS + 60)
    exit_seconds = time.monotonic() - sent
    holder.join()
    states = _queue_states(home)
    FIGURES.update(shutdown_exit_seconds=round(exit_seconds, 1), shutdown_states=states)
    print(f"\nshutdown: {json.dumps(FIGURES)}")
    assert proc.returncode == 0
    assert exit_seconds < SHUTDOWN_SECONDS + 30  # drain bound + uvicorn's close + engine shutdown
    assert states.get("leased", 0) == 0  # nothing is left held by the stopped worker
    assert states.get("queued", 0) > 0, "the batch finished before SIGTERM: make it bigger"

    # Restart, and SIGKILL that server mid-batch (the real engine holding leases) once it made progress.
    with serve(["--model", str(tiny_model_dir)], home, ENV, need_engine=True) as (url2, proc2, _):
        # Progress, but not the whole rest: 200 results, or a quarter of what the drain left.
        progress = states.get("completed", 0) + min(200, max(1, states["queued"] // 4))
        deadline = time.monotonic() + 300
        while _queue_states(home).get("completed", 0) < progress and time.monotonic() < deadline:
            time.sleep(0.2)
        engine = descendants(proc2.pid)  # vLLM's EngineCore and what it started
        assert engine, "no engine process under scalarlm serve"
        proc2.send_signal(signal.SIGKILL)
        proc2.wait()
    # The engine's processes do not outlive the SIGKILLed server (its reaper stops them; before it, the EngineCore
    # kept waiting on its sockets, holding its memory).
    deadline = time.monotonic() + 30
    while any(is_alive(pid, ticks) for pid, ticks in engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid, ticks in engine if is_alive(pid, ticks)], f"engine processes outlived the server: {engine}"
    killed_states = _queue_states(home)
    FIGURES.update(sigkill_states=killed_states)
    print(f"\nsigkill: {json.dumps(killed_states)}")
    assert killed_states.get("queued", 0) + killed_states.get("leased", 0) > 0, "batch finished before SIGKILL"
    # A second restart completes the rest; every item has exactly one result.
    with serve(["--model", str(tiny_model_dir)], home, ENV, need_engine=True) as (url3, _, _):
        got = httpx.post(f"{url3}/v1/generate/get_results", json={"request_ids": ids, "wait_seconds": 300},
                         timeout=400).json()["results"]
    assert len(got) == total and all(r["response"] is not None for r in got)
    with sqlite3.connect(home / "queue.sqlite") as db:
        dup = db.execute("SELECT COUNT(*) FROM items GROUP BY request_id HAVING COUNT(*) > 1").fetchall()
    assert dup == [] and _queue_states(home).get("completed", 0) >= total
