"""`training.stop_grace_seconds` is how long a stopped trainer may take to save its state before SIGKILL."""

from __future__ import annotations

import time

from scalarlm.launcher import LocalLauncher


def test_a_trainer_ignoring_sigterm_is_killed_after_stop_grace_seconds(settings, program, new_job, wait_for) -> None:
    graced = settings.model_copy(update={"training": settings.training.model_copy(update={"stop_grace_seconds": 1.5})})
    launcher = LocalLauncher(graced, entry=program("stubborn"))
    job, config = new_job()
    launcher.submit(job, config)
    assert wait_for(lambda: "ignoring SIGTERM" in launcher.logs(job))
    start = time.monotonic()
    assert launcher.stop_for_shutdown([job]) == [job.job_id]
    took = time.monotonic() - start
    assert launcher.state(job)[0] == "finished" and 1.5 <= took < 15, took  # waited the grace, then SIGKILL
