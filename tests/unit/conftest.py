"""Fixtures shared by the unit tests."""

from __future__ import annotations

import threading
import time

import pytest


class HeldLandings:
    """An `on_landed` that records each landed step and holds the landing thread after step 1 until released, so
    the steps published meanwhile queue behind it."""

    def __init__(self) -> None:
        self.landed: list[int] = []
        self.release = threading.Event()

    def __call__(self, step: int) -> None:
        self.landed.append(step)
        if step == 1:
            self.release.wait(60)

    def wait_for_first(self) -> None:
        deadline = time.monotonic() + 30
        while not self.landed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.landed == [1]


@pytest.fixture
def held() -> HeldLandings:
    """A staging publisher's `on_landed` holding its landing thread after step 1 (release with `held.release`)."""
    return HeldLandings()
