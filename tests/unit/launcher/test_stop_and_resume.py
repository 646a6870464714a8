"""A control plane's shutdown stops its local trainers (state saved, QUEUED); the next one resumes them.

Real subprocesses stand in for the trainer (tests/unit/launcher/conftest.py); the real trainer's side of the
contract is tested in tests/security/test_shutdown_resume.py.
"""

from __future__ import annotations

import asyncio

import pytest

from scalarlm.launcher import LocalLauncher, ResumePolicy, read_record, reconcile
from scalarlm.launcher.base import LaunchRecord, write_record
from scalarlm.launcher.process import is_alive


def test_shutdown_stops_trainers_queued_and_escalates_to_sigkill(settings, program, new_job, wait_for):
    obedient = LocalLauncher(settings, entry=program("obedient"))
    stubborn = LocalLauncher(settings, entry=program("stubborn"), grace_seconds=1.0)
    polite, _ = new_job()
    deaf, _ = new_job()
    obedient.submit(polite, polite.read_config())
    stubborn.submit(deaf, deaf.read_config())
    assert wait_for(lambda: polite.read_status().status == "RUNNING" and "ignoring SIGTERM" in stubborn.logs(deaf))

    assert obedient.stop_for_shutdown([polite]) == [polite.job_id]
    assert stubborn.stop_for_shutdown([deaf]) == [deaf.job_id]

    status = polite.read_status()
    assert status.status == "QUEUED" and "shutdown" in status.reason
    assert obedient.state(polite)[0] == stubborn.state(deaf)[0] == "finished"  # SIGKILLed after 1 s
    assert deaf.read_status().status == "QUEUED"  # never started: the stand-in does not write RUNNING
    assert polite.shutdown_marker.exists() and deaf.shutdown_marker.exists()
    assert obedient.stop_for_shutdown([polite]) == []  # nothing runs any more


def test_restarted_control_plane_resumes_interrupted_jobs(settings, program, new_job, wait_for):
    before = LocalLauncher(settings, entry=program("obedient"))
    job, _ = new_job()
    first_pid = int(before.submit(job, job.read_config()))
    assert wait_for(lambda: job.read_status().status == "RUNNING")
    before.stop_for_shutdown([job])
    (job.state_dir / "latest.json").write_text('{"step": 1, "world_size": 1, "tp": 1}\n')

    after = LocalLauncher(settings, entry=program("obedient"))
    (changed,) = reconcile(settings.jobs_dir, {"local": after})

    assert changed.resumes == 1
    assert changed.reason.startswith("resuming from the state saved at step 1: stopped at step 0 by the control plane's")
    record = read_record(job)
    assert record.pid != first_pid and is_alive(record.pid, record.start_ticks)
    assert not job.shutdown_marker.exists()
    assert wait_for(lambda: job.read_status().status == "RUNNING")
    assert "resuming from the state saved at step 1" in after.logs(job)
    after.cancel(job)
    assert job.read_status().status == "CANCELLED"


def test_resume_none_reports_interrupted_jobs_failed_with_the_way_back(settings, program, new_job, wait_for):
    launcher = LocalLauncher(settings, entry=program("obedient"))
    job, _ = new_job()
    launcher.submit(job, job.read_config())
    assert wait_for(lambda: job.read_status().status == "RUNNING")
    launcher.stop_for_shutdown([job])

    (changed,) = reconcile(settings.jobs_dir, {"local": launcher}, ResumePolicy(interrupted=False))

    assert changed.status == "FAILED" and changed.resumes == 0
    assert f"POST /v1/megatron/resume/{job.job_id} continues it" in changed.reason
    assert not job.shutdown_marker.exists()


def test_crashed_jobs_resume_only_when_configured_and_at_most_max_resumes(settings, program, new_job, wait_for):
    launcher = LocalLauncher(settings, entry=program("crash"))
    job, _ = new_job()
    launcher.submit(job, job.read_config())
    policy = ResumePolicy(crashed=True, max_resumes=2)

    reasons = []
    for _ in range(3):
        assert wait_for(lambda: launcher.state(job)[0] == "finished")
        (changed,) = reconcile(settings.jobs_dir, {"local": launcher}, policy)
        reasons.append((changed.status, changed.resumes))
    assert reasons == [("QUEUED", 1), ("QUEUED", 2), ("FAILED", 2)]
    status = job.read_status()
    assert "exited with code 3" in status.reason and "not resumed again after 2 resumes" in status.reason
    assert launcher.logs(job).count("resuming from the start (no saved state): the trainer crashed") == 2

    other, _ = new_job()
    launcher.submit(other, other.read_config())
    assert wait_for(lambda: launcher.state(other)[0] == "finished")
    (changed,) = reconcile(settings.jobs_dir, {"local": launcher})  # default: crashes are not resumed
    assert changed.status == "FAILED" and changed.resumes == 0


@pytest.mark.parametrize("on_shutdown", ["checkpoint", "detach"])
def test_control_plane_exit_stops_or_leaves_its_trainers(settings, program, new_job, wait_for, on_shutdown):
    from scalarlm.server.jobs import TrainingJobs

    settings = settings.model_copy(update={"training": settings.training.model_copy(update={"on_shutdown": on_shutdown})})
    launcher = LocalLauncher(settings, entry=program("obedient"))
    jobs = TrainingJobs(settings, {"local": launcher})
    job, _ = new_job()
    finished, _ = new_job()
    launcher.submit(job, job.read_config())
    finished.update_status(status="COMPLETED")
    assert wait_for(lambda: job.read_status().status == "RUNNING")

    async def run_and_exit() -> None:
        async with jobs.supervising():
            pass

    asyncio.run(run_and_exit())

    if on_shutdown == "checkpoint":
        assert launcher.state(job)[0] == "finished" and job.read_status().status == "QUEUED"
    else:
        assert launcher.state(job)[0] == "running" and job.read_status().status == "RUNNING"
        launcher.cancel(job)
    assert finished.read_status().status == "COMPLETED" and not finished.shutdown_marker.exists()


def test_interrupted_job_of_another_host_is_resumed_here(settings, program, new_job, wait_for):
    """A rescheduled pod has a new host name: the marker says the old trainer is gone, so this host resumes it."""
    before = LocalLauncher(settings, entry=program("obedient"))
    job, _ = new_job()
    before.submit(job, job.read_config())
    assert wait_for(lambda: job.read_status().status == "RUNNING")
    before.stop_for_shutdown([job])
    write_record(job, read_record(job).model_copy(update={"host": "old-pod-7f9c"}))
    running, _ = new_job()
    write_record(running, LaunchRecord(launcher="local", launcher_id="1", host="old-pod-7f9c", pid=1))

    after = LocalLauncher(settings, entry=program("obedient"))
    (changed,) = reconcile(settings.jobs_dir, {"local": after})

    assert changed.job_id == job.job_id and changed.resumes == 1
    assert running.read_status().status == "QUEUED"  # no marker: another host's job is left to that host
    assert wait_for(lambda: job.read_status().status == "RUNNING")
    after.cancel(job)
