"""QueueService: the in-process WorkSource and long-poll waits, on a real SQLite file."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from scalarlm.protocol.backend import WorkSource
from scalarlm.protocol.errors import NotFound
from scalarlm.protocol.generate import Completion, FinishWorkRequest, GetWorkRequest, ModelVersion, WorkResult
from scalarlm.queue import QueueService, RequestQueue


@pytest.fixture
def service(tmp_path: Path) -> QueueService:
    svc = QueueService(
        RequestQueue(tmp_path / "q.sqlite", lease_seconds=60),
        max_lease_batch=8,
        idle_wait=0.05,
        models=lambda: [ModelVersion(name="m")],
    )
    yield svc
    svc.close()


def done(item_id: str, text: str) -> WorkResult:
    return WorkResult(request_id=item_id, model="m", outputs=[Completion(text=text)])


async def test_is_a_work_source_and_caps_leases(service: QueueService) -> None:
    assert isinstance(service, WorkSource)
    batch = await service.enqueue([{"prompt": str(i)} for i in range(20)], "m")
    reply = await service.get_work(GetWorkRequest(worker_id="w", capacity=100))
    assert len(reply.requests) == 8 and reply.lease_seconds == 60 and reply.models[0].name == "m"
    finish = await service.finish_work(FinishWorkRequest(results=[done(r.request_id, "x") for r in reply.requests]))
    assert (finish.accepted, finish.duplicates) == (8, 0)
    again = await service.finish_work(FinishWorkRequest(results=[done(reply.requests[0].request_id, "y")]))
    assert (again.accepted, again.duplicates) == (0, 1)
    assert (await service.get(batch.request_ids[:1]))[0].response == "x"


async def test_idle_get_work_answers_empty_after_a_short_wait(service: QueueService) -> None:
    reply = await service.get_work(GetWorkRequest(capacity=4))
    assert reply.requests == []


async def test_idle_get_work_wakes_when_work_arrives(tmp_path: Path) -> None:
    svc = QueueService(RequestQueue(tmp_path / "q.sqlite"), idle_wait=30)
    pending = asyncio.create_task(svc.get_work(GetWorkRequest(capacity=4)))
    await asyncio.sleep(0.05)
    start = time.monotonic()
    await svc.enqueue([{"prompt": "hi"}], "m")
    reply = await asyncio.wait_for(pending, 10)
    assert [r.prompt for r in reply.requests] == ["hi"]
    assert time.monotonic() - start < 10
    svc.close()


async def test_wait_results_returns_as_soon_as_all_are_finished(service: QueueService) -> None:
    batch = await service.enqueue([{"prompt": "a"}, {"prompt": "b"}], "m")

    async def worker() -> None:
        items = (await service.get_work(GetWorkRequest(capacity=2))).requests
        for item in items:
            await asyncio.sleep(0.05)
            await service.finish_work(FinishWorkRequest(results=[done(item.request_id, item.prompt.upper())]))

    task = asyncio.create_task(worker())
    start = time.monotonic()
    results = await service.wait_results(batch.request_ids, timeout=60)
    assert [r.response for r in results] == ["A", "B"]
    assert time.monotonic() - start < 30  # woke on finish_work, not at the timeout
    await task


async def test_wait_results_gives_partial_results_at_timeout(service: QueueService) -> None:
    batch = await service.enqueue([{"prompt": "a"}, {"prompt": "b"}], "m")
    items = (await service.get_work(GetWorkRequest(capacity=1))).requests
    await service.finish_work(FinishWorkRequest(results=[done(items[0].request_id, "A")]))
    results = await service.wait_results(batch.request_ids, timeout=0.1)
    assert [r.response for r in results] == ["A", None]
    assert await service.wait_batch(batch.batch_id, timeout=0.1) == (2, 1)


class CountingQueue(RequestQueue):
    """The real SQLite queue, counting the reads a long-poll makes."""

    reads = 0

    def get(self, request_ids):  # type: ignore[no-untyped-def]
        self.reads += 1
        return super().get(request_ids)

    def unfinished(self, request_ids):  # type: ignore[no-untyped-def]
        self.reads += 1
        return super().unfinished(request_ids)

    def batch_counts(self, batch_id):  # type: ignore[no-untyped-def]
        self.reads += 1
        return super().batch_counts(batch_id)


async def test_a_long_poll_reads_sqlite_only_when_its_own_results_can_have_finished_it(tmp_path: Path) -> None:
    queue = CountingQueue(tmp_path / "q.sqlite")
    service = QueueService(queue, recheck_interval=60)
    mine = await service.enqueue([{"prompt": "a"}, {"prompt": "b"}], "m")
    other = await service.enqueue([{"prompt": str(i)} for i in range(4)], "m")
    items = {i.request_id: i for i in (await service.get_work(GetWorkRequest(capacity=6))).requests}
    results = asyncio.create_task(service.wait_results(mine.request_ids, timeout=60))
    batch = asyncio.create_task(service.wait_batch(mine.batch_id, timeout=60))
    await asyncio.sleep(0.1)
    reads = queue.reads  # each wait's first read
    for rid in other.request_ids:  # another batch's results: neither wait reads anything
        await service.finish_work(FinishWorkRequest(results=[done(rid, "x")]))
    await service.finish_work(FinishWorkRequest(results=[done(mine.request_ids[0], "A")]))
    await asyncio.sleep(0.1)  # one of two: still too few to finish either wait
    assert queue.reads == reads and not results.done() and not batch.done()
    await service.finish_work(FinishWorkRequest(results=[done(mine.request_ids[1], items[mine.request_ids[1]].prompt)]))
    assert [r.response for r in await asyncio.wait_for(results, 5)] == ["A", "b"]
    assert await asyncio.wait_for(batch, 5) == (2, 2)
    assert queue.reads == reads + 2  # the results' final read, the batch's count
    service.close()


async def test_a_long_poll_sees_results_another_process_stored_at_its_periodic_re_read(tmp_path: Path) -> None:
    service = QueueService(RequestQueue(tmp_path / "q.sqlite"), recheck_interval=0.1)
    batch = await service.enqueue([{"prompt": "a"}], "m")
    elsewhere = RequestQueue(tmp_path / "q.sqlite")  # e.g. a second API server process on the same file
    elsewhere.lease(1, "w")
    results = asyncio.create_task(service.wait_results(batch.request_ids, timeout=60))
    counts = asyncio.create_task(service.wait_batch(batch.batch_id, timeout=60))
    await asyncio.sleep(0.2)
    elsewhere.complete([done(batch.request_ids[0], "A")])
    assert [r.response for r in await asyncio.wait_for(results, 10)] == ["A"]
    assert await asyncio.wait_for(counts, 10) == (1, 1)
    elsewhere.close()
    service.close()


async def test_unknown_ids_raise_not_found(service: QueueService) -> None:
    with pytest.raises(NotFound):
        await service.wait_results(["missing_000000000"], timeout=1)
    with pytest.raises(NotFound):
        await service.wait_batch("missing", timeout=1)


async def test_housekeeping_expires_leases_and_deletes_old_results(tmp_path: Path) -> None:
    svc = QueueService(RequestQueue(tmp_path / "q.sqlite", lease_seconds=0.05), idle_wait=0)
    batch = await svc.enqueue([{"prompt": "a"}, {"prompt": "b"}], "m")
    first = (await svc.get_work(GetWorkRequest(capacity=1))).requests
    await svc.finish_work(FinishWorkRequest(results=[done(first[0].request_id, "A")]))
    await svc.get_work(GetWorkRequest(capacity=1))  # leased, then its worker goes silent
    task = asyncio.create_task(svc.housekeeping(retention_seconds=0.01, interval=0.1))
    await asyncio.sleep(0.5)
    task.cancel()
    counts = await svc.counts()
    assert (counts.queued, counts.leased, counts.completed) == (1, 0, 0)
    with pytest.raises(NotFound):
        await svc.get(batch.request_ids[:1])
    svc.close()


async def test_a_clear_wakes_the_long_polls_of_what_it_cleared(tmp_path: Path) -> None:
    """get_results and a batch's wait return as soon as clear_queue fails their items, not at the next re-read."""
    service = QueueService(RequestQueue(tmp_path / "q.sqlite"), recheck_interval=60)
    batch = await service.enqueue([{"prompt": "a"}, {"prompt": "b"}], "m")
    [item] = (await service.get_work(GetWorkRequest(capacity=1))).requests
    await service.finish_work(FinishWorkRequest(results=[done(item.request_id, "A")]))
    results = asyncio.create_task(service.wait_results(batch.request_ids, timeout=120))
    counts = asyncio.create_task(service.wait_batch(batch.batch_id, timeout=120))
    await asyncio.sleep(0.1)
    assert not results.done() and not counts.done()
    assert await service.clear() == 1
    finished = await asyncio.wait_for(results, 30)  # (the re-read would come after 60 s)
    assert [(r.status, r.response) for r in finished] == [("completed", "A"), ("failed", None)]
    assert await asyncio.wait_for(counts, 30) == (2, 2)
    service.close()
