"""An idle RL session's poll backs off: 15 ms right after a request, growing with the idle time up to 0.5 s."""

from __future__ import annotations

from scalarlm.training.session_loop import MAX_POLL_SECONDS, POLL_SECONDS, idle_reason, poll_interval


def test_poll_starts_fast_and_backs_off_to_half_a_second() -> None:
    waits = [poll_interval(s) for s in (0.0, 0.5, 2.0, 5.0, 10.0, 60.0, 3600.0)]
    assert waits[0] == waits[1] == POLL_SECONDS  # a client stepping back to back is picked up at once
    assert waits == sorted(waits) and POLL_SECONDS < waits[3] < MAX_POLL_SECONDS
    assert waits[-1] == waits[-2] == MAX_POLL_SECONDS == 0.5
    assert all(w <= max(POLL_SECONDS, 0.02 * s) for w, s in zip(waits, (0.0, 0.5, 2.0, 5.0, 10.0, 60.0, 3600.0)))


def test_idle_reason_names_the_setting_and_the_saved_step() -> None:
    reason = idle_reason(1800.0, 7)
    assert "idle for 1800 s" in reason and "training.session_idle_seconds" in reason and "step 7" in reason
