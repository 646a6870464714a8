"""The one-node SLURM test cluster runs real batch jobs: a job completes, a cancelled job is CANCELLED."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]


def test_batch_job_completes_and_writes_its_output(slurm_cluster, tmp_path):
    out = tmp_path / "out.txt"
    job = slurm_cluster.run("sbatch", "--parsable", "-o", str(out), "--wrap", "echo hello from $SLURM_JOB_ID").strip()

    assert slurm_cluster.wait_state(job, {"COMPLETED"}, timeout=60) == "COMPLETED"
    assert out.read_text().strip() == f"hello from {job}"


def test_scancel_leaves_the_job_cancelled(slurm_cluster, tmp_path):
    job = slurm_cluster.run("sbatch", "--parsable", "-o", str(tmp_path / "o.txt"), "--wrap", "sleep 300").strip()
    assert slurm_cluster.wait_state(job, {"RUNNING"}, timeout=60) == "RUNNING"

    slurm_cluster.run("scancel", job)

    # KillWait is 5 s; a cancel landing while the batch step starts can take that long.
    assert slurm_cluster.wait_state(job, {"CANCELLED"}, timeout=30) == "CANCELLED"
    rows = slurm_cluster.run("sacct", "-c", "-n", "-P", "-j", job, "-o", "JobID,State").splitlines()
    assert f"{job}|CANCELLED" in rows
