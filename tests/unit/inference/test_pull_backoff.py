"""`generate.poll_interval`: how long an idle worker waits before asking an empty queue again, shown on the waits the
pull loop asks for (a fake clock and a recorded pause: no sleeping, nothing timed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scalarlm.config import Settings
from scalarlm.inference import pull_loop
from scalarlm.inference.load import LoadTracker
from scalarlm.inference.pull_loop import MAX_BACKOFF, PullLoop
from scalarlm.protocol.generate import GetWorkResponse


class Clock:
    """Stands in for the pull loop's `time` module: monotonic() reads a number the source advances."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class EmptyQueue:
    """A work source that answers `answers` empty replies, each after `answer_seconds` (0: at once), or fails."""

    def __init__(self, clock: Clock, answers: int, answer_seconds: float = 0.0, fail: bool = False) -> None:
        self.clock, self.answers, self.answer_seconds, self.fail = clock, answers, answer_seconds, fail
        self.calls = 0
        self.loop: PullLoop | None = None

    async def get_work(self, request):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls >= self.answers:
            assert self.loop is not None
            self.loop._stopping = True  # this is the last answer: the loop ends after handling it
        self.clock.now += self.answer_seconds
        if self.fail:
            raise ConnectionError("control plane restarting")
        return GetWorkResponse(requests=[], lease_seconds=60.0)


async def _waits(monkeypatch: pytest.MonkeyPatch, tmp_path, poll: float, answers: int = 8, **source) -> list[float]:  # type: ignore[no-untyped-def]
    """The pauses an idle worker with `generate.poll_interval = poll` takes between `answers` empty replies."""
    clock = Clock()
    monkeypatch.setattr(pull_loop, "time", clock)
    settings = Settings(home=tmp_path, generate={"poll_interval": poll})
    engine = SimpleNamespace(load=LoadTracker(max_num_seqs=4), llm=SimpleNamespace(errored=False))
    queue = EmptyQueue(clock, answers, **source)
    loop = PullLoop(engine, queue, settings, worker_id="w")  # type: ignore[arg-type]
    queue.loop = loop
    waits: list[float] = []

    async def pause(event, seconds: float) -> None:  # type: ignore[no-untyped-def]
        waits.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(loop, "_pause", pause)
    await loop._pull_forever()
    assert queue.calls == answers
    return waits


async def test_an_idle_worker_waits_poll_interval_then_doubles_up_to_the_cap(monkeypatch, tmp_path) -> None:
    waits = await _waits(monkeypatch, tmp_path, poll=0.02)
    assert waits == pytest.approx([0.02, 0.04, 0.08, 0.16, 0.32, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF])
    assert await _waits(monkeypatch, tmp_path, poll=0.1, answers=4) == pytest.approx([0.1, 0.2, 0.4, MAX_BACKOFF])


async def test_a_poll_interval_beyond_the_cap_is_kept(monkeypatch, tmp_path) -> None:
    # Before, the doubling capped at MAX_BACKOFF shrank a 2 s interval to 0.5 s after the first wait.
    assert await _waits(monkeypatch, tmp_path, poll=2.0, answers=4) == pytest.approx([2.0, 2.0, 2.0, 2.0])


async def test_a_source_that_long_polled_for_poll_interval_is_asked_again_at_once(monkeypatch, tmp_path) -> None:
    # The control plane waits for new work before answering empty: having waited 1 s, the worker asks again at once...
    assert await _waits(monkeypatch, tmp_path, poll=0.5, answers=4, answer_seconds=1.0) == []
    # ... unless it answered sooner than poll_interval: then the worker waits as after an immediate answer.
    assert await _waits(monkeypatch, tmp_path, poll=2.0, answers=3, answer_seconds=1.0) == pytest.approx([2.0] * 3)


async def test_a_failing_source_is_retried_after_poll_interval_doubling(monkeypatch, tmp_path) -> None:
    waits = await _waits(monkeypatch, tmp_path, poll=0.05, answers=5, fail=True)
    assert waits == pytest.approx([0.05, 0.1, 0.2, 0.4, MAX_BACKOFF])
