"""RequestQueue on a real SQLite file: leasing, expiry, retries, FIFO by model, counts, clear, a 10k batch."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from scalarlm.protocol.errors import NotFound
from scalarlm.protocol.generate import Completion, WorkResult
from scalarlm.queue import RequestQueue
from scalarlm.queue.store import CLEARED, batch_of


def prompts(n: int, **sampling: object) -> list[dict]:
    return [{"prompt": f"p{i}", "sampling": dict(sampling)} for i in range(n)]


def result(request_id: str, text: str = "out", model: str = "m", error: str | None = None) -> WorkResult:
    outputs = None if error else [Completion(text=text, finish_reason="length", token_ids=[1, 2, 3])]
    return WorkResult(request_id=request_id, model=model, outputs=outputs, error=error, prompt_tokens=2)


@pytest.fixture
def queue(tmp_path: Path) -> RequestQueue:
    q = RequestQueue(tmp_path / "queue.sqlite", lease_seconds=10)
    yield q
    q.close()


def test_enqueue_gives_scalarlm_request_ids_and_payload_reaches_worker(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(3, max_tokens=5, temperature=0.7), "m")
    assert batch.count == 3
    assert batch.request_ids == [f"{batch.batch_id}_{i:09d}" for i in range(3)]
    items = queue.lease(10, "w")
    assert [i.request_id for i in items] == batch.request_ids
    assert items[0].prompt == "p0" and items[0].model == "m"
    assert items[0].sampling.max_tokens == 5 and items[0].sampling.temperature == 0.7


def test_results_unfinished_then_finished(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(2), "m")
    first = queue.get(batch.request_ids)
    assert [r.response for r in first] == [None, None] and first[0].status == "queued"
    queue.lease(2, "w")
    assert queue.complete([result(batch.request_ids[0], "hello")]) == (1, 0)
    done, pending = queue.get(batch.request_ids)
    assert done.response == "hello" and done.status == "completed" and done.completion_tokens == 3
    assert done.finish_reason == "length" and done.prompt_tokens == 2 and done.version == 0
    assert pending.response is None and pending.status == "leased"


def test_unfinished_names_the_queued_and_leased_ids_and_each_id_names_its_batch(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(3), "m")
    queue.enqueue(prompts(5), "m")
    queue.lease(2, "w")
    queue.complete([result(batch.request_ids[0]), result(batch.request_ids[2], error="boom")])
    assert queue.unfinished(batch.request_ids) == [batch.request_ids[1]]
    assert {batch_of(rid) for rid in batch.request_ids} == {batch.batch_id}


def test_unknown_request_id_names_it(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(1), "m")
    with pytest.raises(NotFound, match="nope_000000001"):
        queue.get([batch.request_ids[0], "nope_000000001"])


def test_expired_lease_returns_item_and_retry_yields_one_result(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(1), "m")
    t0 = time.time()
    [item] = queue.lease(1, "w1", now=t0)
    assert queue.lease(1, "w2", now=t0 + 5) == []  # still leased
    [again] = queue.lease(1, "w2", now=t0 + 11)  # lease expired: handed out again
    assert again.request_id == item.request_id
    assert queue.complete([result(item.request_id, "from w2")]) == (1, 0)
    assert queue.complete([result(item.request_id, "from w1, late")]) == (0, 1)
    [res] = queue.get(batch.request_ids)
    assert res.response == "from w2"
    assert queue.counts().completed == 1 and queue.counts().leased == 0


def test_result_for_expired_but_not_released_lease_counts(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(1), "m")
    t0 = time.time()
    queue.lease(1, "w1", now=t0)
    assert queue.expire_leases(now=t0 + 11) == 1
    assert queue.counts().queued == 1
    assert queue.complete([result(batch.request_ids[0], "late but first")]) == (1, 0)
    assert queue.lease(1, "w2", now=t0 + 12) == []
    assert queue.get(batch.request_ids)[0].response == "late but first"


def test_failed_item_keeps_error_text(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(1), "m")
    queue.lease(1, "w")
    queue.complete([result(batch.request_ids[0], error="prompt too long")])
    [res] = queue.get(batch.request_ids)
    assert res.status == "failed" and res.error == "prompt too long" and res.response is None
    assert queue.counts().failed == 1


def test_fifo_and_one_model_per_lease(queue: RequestQueue) -> None:
    a1 = queue.enqueue(prompts(2), "a")
    b1 = queue.enqueue(prompts(2), "b")
    a2 = queue.enqueue(prompts(2), "a")
    first = queue.lease(10, "w")
    assert [i.request_id for i in first] == a1.request_ids + a2.request_ids  # oldest model, all its items
    second = queue.lease(10, "w")
    assert [i.request_id for i in second] == b1.request_ids
    assert queue.lease(10, "w") == []


def test_capacity_bounds_lease_and_order_is_fifo(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(5), "m")
    assert [i.request_id for i in queue.lease(2, "w")] == batch.request_ids[:2]
    assert [i.request_id for i in queue.lease(2, "w")] == batch.request_ids[2:4]
    assert queue.lease(0, "w") == []


def test_per_item_model_overrides_batch_model(queue: RequestQueue) -> None:
    queue.enqueue([{"prompt": "x", "model": "other"}, {"prompt": "y"}], "m")
    assert [i.model for i in queue.lease(10, "w")] == ["other"]
    assert [i.model for i in queue.lease(10, "w")] == ["m"]


def test_clear_fails_what_is_queued_or_leased_and_keeps_finished_results(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(4), "m")
    queue.lease(2, "w")
    queue.complete([result(batch.request_ids[0])])
    counts = queue.counts()
    assert (counts.queued, counts.leased, counts.completed, counts.failed) == (2, 1, 1, 0)
    assert queue.throughput(60).requests == 1
    assert sorted(queue.clear()) == sorted(batch.request_ids[1:])
    assert queue.counts().model_dump() == {"queued": 0, "leased": 0, "completed": 1, "failed": 3}
    # one read of the whole batch: the finished result and, for the rest, an error saying they were cleared
    first, *cleared = queue.get(batch.request_ids)
    assert first.response == "out" and first.status == "completed"
    assert [(r.status, r.error, r.response) for r in cleared] == [("failed", CLEARED, None)] * 3
    assert queue.lease(10, "w") == []
    assert queue.complete([result(batch.request_ids[1], "late")]) == (0, 1)  # the leased one's late result: ignored
    assert queue.get(batch.request_ids[1:2])[0].error == CLEARED
    assert queue.batch_counts(batch.batch_id) == (4, 4)  # a download of the batch completes
    assert queue.throughput(60).requests == 1  # cleared items were not served


def test_batch_progress_partial(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(3), "m")
    queue.lease(3, "w")
    queue.complete([result(batch.request_ids[1], "mid")])
    progress = queue.batch_progress(batch.batch_id)
    assert (progress.total, progress.finished) == (3, 1)
    assert list(progress.results) == batch.request_ids
    assert progress.results[batch.request_ids[1]].response == "mid"
    with pytest.raises(NotFound):
        queue.batch_progress("missing")


def test_generator_that_fails_rolls_back_whole_batch(queue: RequestQueue) -> None:
    def items():
        yield {"prompt": "ok"}
        raise ValueError("bad item 1")

    with pytest.raises(ValueError):
        queue.enqueue(items(), "m")
    assert queue.counts().queued == 0


def test_throughput_counts_recent_tokens(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(2), "m")
    queue.lease(2, "w")
    queue.complete([result(r) for r in batch.request_ids])
    recent = queue.throughput(60)
    assert recent.requests == 2 and recent.tokens == 6 and recent.seconds >= 1.0
    assert queue.totals() == (2, 6)


def test_ten_thousand_prompts_all_leased_and_completed(queue: RequestQueue) -> None:
    batch = queue.enqueue(prompts(10_000, max_tokens=4), "m")
    seen: set[str] = set()
    while items := queue.lease(1024, "w"):
        seen.update(i.request_id for i in items)
        queue.complete([result(i.request_id, i.prompt) for i in items])
    assert len(seen) == 10_000
    progress = queue.batch_progress(batch.batch_id)
    assert progress.finished == 10_000
    assert all(progress.results[rid].response == f"p{i}" for i, rid in enumerate(batch.request_ids))


def test_concurrent_leases_from_threads_never_share_an_item(tmp_path: Path) -> None:
    path = tmp_path / "queue.sqlite"
    RequestQueue(path).enqueue(prompts(600), "m")
    leased: list[str] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        q = RequestQueue(path)  # its own connection, as another process would have
        while items := q.lease(7, name):
            with lock:
                leased.extend(i.request_id for i in items)
        q.close()

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(leased) == 600 and len(set(leased)) == 600


def test_finished_pages_walk_a_batch_in_prompt_order(queue: RequestQueue) -> None:
    other = queue.enqueue(prompts(3), "m")
    batch = queue.enqueue(prompts(7), "m")
    items = queue.lease(20, "w")
    queue.complete([result(i.request_id, i.prompt) for i in items if i.request_id != batch.request_ids[2]])
    seen, after = [], None
    while page := queue.finished_page(batch.batch_id, after, 2):
        seen.extend(page)
        after = page[-1]["request_id"]
    assert [r["request_id"] for r in seen] == [r for r in batch.request_ids if r != batch.request_ids[2]]
    assert seen[0]["response"] == "p0" and seen[0]["status"] == "completed" and seen[0]["completion_tokens"] == 3
    assert other.batch_id not in "".join(r["request_id"] for r in seen)


def test_reads_do_not_wait_for_a_long_enqueue(queue: RequestQueue) -> None:
    earlier = queue.enqueue(prompts(2), "m")
    seen_during: list[int] = []

    def slow_items():
        for i in range(3):
            # Mid-transaction reads answer at once, from the last committed state.
            seen_during.append(queue.counts().queued)
            assert queue.get(earlier.request_ids)[0].status == "queued"
            yield {"prompt": f"late{i}"}

    queue.enqueue(slow_items(), "m")
    assert seen_during == [2, 2, 2]
    assert queue.counts().queued == 5


def test_a_worker_keeps_to_the_weights_it_holds_until_the_oldest_item_waited_too_long(queue: RequestQueue) -> None:
    """Affinity: work for the model a worker holds is leased before older work for another full-weight model,
    for at most `affinity_seconds`; then FIFO wins, so no model starves."""
    a = queue.enqueue(prompts(2), "job-a")
    b = queue.enqueue(prompts(2), "job-b")
    now = time.time()
    held_b = queue.lease(10, "w-b", now=now, prefer={"job-b"})
    assert [i.model for i in held_b] == ["job-b", "job-b"]  # younger, but what w-b holds
    fifo = queue.lease(10, "w-none", now=now)
    assert [i.request_id for i in fifo] == a.request_ids
    later = queue.enqueue(prompts(1), "job-b")
    queue.enqueue(prompts(1), "job-a")
    queue.enqueue(prompts(1), "job-b")
    assert queue.lease(1, "w-a", prefer={"job-a"})[0].model == "job-a"  # within the window: what it holds
    time.sleep(0.3)
    # The oldest queued item (later's job-b) has now waited past the window: a job-a holder takes it.
    starving = queue.lease(10, "w-a", prefer={"job-a"}, affinity_seconds=0.2)
    assert starving[0].request_id == later.request_ids[0] and {i.model for i in starving} == {"job-b"}
    assert len(b.request_ids) == 2


def test_stored_payloads_are_the_items_json_without_model() -> None:
    """The enqueue fast path (one sampling dict encoded once per batch) stores exactly json.dumps(item - model)."""
    from scalarlm.queue.store import _PayloadEncoder

    shared = {"max_tokens": 4, "temperature": 0.5, "stop": ["\n", "é"]}
    items = [{"prompt": p, "sampling": shared, "model": "m"} for p in ("plain", 'q"uote\\', "naïve ✓ 中文", "\n\t\x00")]
    items += [{"prompt": "own sampling", "sampling": {"max_tokens": 1}},
              {"messages": [{"role": "user", "content": "hi"}], "sampling": shared, "model": "m"},
              {"prompt": "after", "sampling": shared}]
    encode = _PayloadEncoder()
    for item in items:
        body = {k: v for k, v in item.items() if k != "model"}
        assert encode(item) == json.dumps(body, separators=(",", ":"))
        assert json.loads(encode(item)) == body
