"""LocalLauncher with real subprocesses: failure reasons, cancel (SIGTERM, then SIGKILL), restart reconciliation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scalarlm.launcher import LocalLauncher, read_record, reconcile
from scalarlm.launcher.base import LaunchRecord, write_record
from scalarlm.launcher.process import start_ticks
from scalarlm.protocol.errors import EngineUnavailable


def test_crashed_trainer_is_failed_with_exit_code_last_step_and_output(settings, program, new_job, wait_for):
    launcher = LocalLauncher(settings, entry=program("crash"))
    job, config = new_job()
    pid = int(launcher.submit(job, config))

    assert wait_for(lambda: launcher.state(job)[0] == "finished")
    changed = reconcile(settings.jobs_dir, {"local": launcher})

    status = job.read_status()
    assert [s.job_id for s in changed] == [job.job_id]
    assert status.status == "FAILED"
    assert f"trainer process {pid} exited with code 3 without a final status" in status.reason
    assert "last step 2" in status.reason
    assert "RuntimeError: out of memory in step 3" in status.reason
    assert "RuntimeError: out of memory" in launcher.logs(job)


def test_a_trainer_killed_between_a_rename_and_the_pointer_leaves_latest_at_the_renamed_step(
        settings, program, new_job, wait_for):
    launcher = LocalLauncher(settings, entry=program("crash_before_pointer"))
    job, config = new_job()
    launcher.submit(job, config)

    assert wait_for(lambda: launcher.state(job)[0] == "finished")
    reconcile(settings.jobs_dir, {"local": launcher})

    status = job.read_status()
    assert status.status == "FAILED" and "(checkpoint step-2)" in status.reason, status.reason
    assert (job.checkpoints_dir / "latest").read_text() == "step-2\n"


def test_a_trainer_killed_before_its_staged_step_landed_gets_it_landed(settings, program, new_job, wait_for, tmp_path):
    from scalarlm.checkpoint import latest_step, list_steps

    launcher = LocalLauncher(settings, entry=[*program("crash_before_landing"), str(tmp_path / "shm")])
    job, config = new_job()
    launcher.submit(job, config)

    assert wait_for(lambda: launcher.state(job)[0] == "finished")
    reconcile(settings.jobs_dir, {"local": launcher})

    assert list_steps(job) == [1, 2] and latest_step(job) == 2  # the served version stays, now durable
    assert (job.step_dir(2) / "model.safetensors").read_bytes() == b"weights of step 2"
    status = job.read_status()
    assert status.status == "FAILED" and "(checkpoint step-2)" in status.reason, status.reason


def test_completed_job_is_left_alone(settings, program, new_job, wait_for):
    launcher = LocalLauncher(settings, entry=program("complete"))
    job, config = new_job()
    launcher.submit(job, config)

    assert wait_for(lambda: launcher.state(job)[0] == "finished")
    assert reconcile(settings.jobs_dir, {"local": launcher}) == []
    assert job.read_status().status == "COMPLETED"


def test_cancel_lets_the_trainer_report_cancelled(settings, program, new_job, wait_for):
    launcher = LocalLauncher(settings, entry=program("obedient"))
    job, config = new_job()
    launcher.submit(job, config)
    assert wait_for(lambda: job.read_status().status == "RUNNING")

    launcher.cancel(job)

    status = job.read_status()
    assert status.status == "CANCELLED"
    assert status.reason == "cancelled at step 1 (state saved)"  # the trainer's own words, not overwritten
    assert launcher.state(job)[0] == "finished"
    assert reconcile(settings.jobs_dir, {"local": launcher}) == []


def test_cancel_escalates_to_sigkill_when_sigterm_is_ignored(settings, program, new_job, wait_for):
    launcher = LocalLauncher(settings, entry=program("stubborn"), grace_seconds=1.0)
    job, config = new_job()
    launcher.submit(job, config)
    assert wait_for(lambda: "ignoring SIGTERM" in launcher.logs(job))

    launcher.cancel(job)

    assert launcher.state(job)[0] == "finished"
    status = job.read_status()
    assert (status.status, status.reason) == ("CANCELLED", "cancelled by user")


def test_restarted_control_plane_fails_a_running_job_whose_process_died(settings, program, new_job, wait_for):
    before = LocalLauncher(settings, entry=program("crash"))
    job, config = new_job()
    pid = int(before.submit(job, config))
    job.update_status(status="RUNNING", step=2)
    assert wait_for(lambda: before.state(job)[0] == "finished")
    del before  # the old control plane is gone; a new one knows the job only from its directory

    after = LocalLauncher(settings)
    assert after.state(job) == ("finished", f"trainer process {pid} exited")
    reconcile(settings.jobs_dir, {"local": after})

    status = job.read_status()
    assert status.status == "FAILED"
    assert status.reason.startswith(f"trainer process {pid} exited without a final status; last step 2")


def test_restarted_control_plane_keeps_a_live_job_running(settings, program, new_job, wait_for):
    before = LocalLauncher(settings, entry=program("obedient"))
    job, config = new_job()
    before.submit(job, config)
    assert wait_for(lambda: job.read_status().status == "RUNNING")

    after = LocalLauncher(settings)  # a fresh control plane: not the process's parent
    assert after.state(job) == ("running", None)
    assert reconcile(settings.jobs_dir, {"local": after}) == []
    after.cancel(job)  # cancel works from a control plane that did not start the job
    assert job.read_status().status == "CANCELLED"
    before.state(job)  # reap the child


def test_a_reused_pid_is_not_mistaken_for_the_trainer(settings, new_job):
    job, _ = new_job()
    me = os.getpid()  # alive, but started at a different time than the record says
    write_record(job, LaunchRecord(launcher="local", launcher_id=str(me), pid=me, start_ticks=start_ticks(me) - 1))
    job.update_status(status="RUNNING")

    reconcile(settings.jobs_dir, {"local": LocalLauncher(settings)})

    assert job.read_status().status == "FAILED"
    assert read_record(job).pid == me


def test_job_never_handed_to_a_launcher_is_failed(settings, new_job):
    job, _ = new_job()
    reconcile(settings.jobs_dir, {"local": LocalLauncher(settings)})
    status = job.read_status()
    assert status.status == "FAILED"
    assert "before the job was handed to a launcher" in status.reason


def test_one_rank_runs_the_trainer_module_directly(settings, new_job):
    job, config = new_job()
    assert LocalLauncher(settings).command(job, config) == [sys.executable, "-m", "scalarlm.training", str(job.root)]


@pytest.mark.skipif(subprocess.run(["which", "mpirun"], capture_output=True).returncode != 0, reason="no mpirun")
def test_several_ranks_run_under_mpirun(settings, new_job):
    job, config = new_job(cpu_ranks=3)
    cmd = LocalLauncher(settings).command(job, config)
    assert cmd[1:6] == ["-n", "3", "--bind-to", "none", "--oversubscribe"]
    assert cmd[-4:] == [sys.executable, "-m", "scalarlm.training", str(job.root)]


def test_several_ranks_under_mpirun_really_run(settings, program, new_job, tmp_path, wait_for):
    """Two ranks start under mpirun (as root, thanks to the env the launcher sets) and both write their rank."""
    if subprocess.run(["which", "mpirun"], capture_output=True).returncode != 0:
        pytest.skip("no mpirun")
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys, pathlib\n"
        "rank = os.environ['OMPI_COMM_WORLD_RANK']\n"
        "(pathlib.Path(sys.argv[1]) / f'rank-{rank}.txt').write_text(os.environ['MASTER_PORT'])\n"
    )
    launcher = LocalLauncher(settings, entry=[str(script)])
    job, config = new_job(cpu_ranks=2)
    launcher.submit(job, config)
    assert wait_for(lambda: launcher.state(job)[0] == "finished", timeout=60)
    assert sorted(p.name for p in job.root.glob("rank-*.txt")) == ["rank-0.txt", "rank-1.txt"], launcher.logs(job)


def test_missing_mpirun_is_a_clear_error(settings, new_job, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    job, config = new_job(cpu_ranks=2)
    with pytest.raises(EngineUnavailable, match="mpirun"):
        LocalLauncher(settings).command(job, config)
