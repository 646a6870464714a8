"""A real training job through the control plane on the real SLURM test cluster (`launcher: slurm`).

The control plane's own SlurmLauncher writes the sbatch script into the job directory and calls
sbatch/squeue/scancel from PATH (SLURM_CONF points at the test cluster); slurmd runs the real trainer
(`python -m scalarlm.training <job_dir>`, megatron-core on CPU) on the tiny model.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from scalarlm.checkpoint import JobDir
from scalarlm.config import Settings
from scalarlm.launcher import read_record
from scalarlm.server.app import create_app

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]

ROWS = [{"input": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(16)]
# Small enough for 2 CPU cores: a few steps of the tiny model, a checkpoint published at every step.
TRAIN_ARGS = {"launcher": "slurm", "gpus": 0, "cpu_ranks": 1, "max_steps": 2, "steps_per_checkpoint": 1,
              "learning_rate": 1e-3, "max_seq_len": 64, "timeout": 600, "dtype": "float32"}  # fmt: skip
# Two ranks (srun tasks, gloo) where the node has the CPUs: a job asking for more would pend for ever.
RANKS = min(2, os.cpu_count() or 1)
# The cluster's own options (training.sbatch_options), as a site adds its partition, account or CPUs per rank.
SBATCH_OPTIONS = ["--comment=scalarlm-ci", "--cpus-per-task=1"]


@pytest.fixture
def slurm_client(slurm_cluster, tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> Iterator[TestClient]:
    """The real control plane with the SLURM launcher chosen in its settings."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))  # SlurmLauncher calls sbatch/squeue from PATH
    settings = Settings(home=tmp_path / "home", model=str(tiny_model_dir),
                        training={"launcher": "slurm", "poll_seconds": 0.5, "sbatch_options": SBATCH_OPTIONS})
    with TestClient(create_app(settings)) as client:
        yield client


def submit(client: TestClient, args: dict) -> str:
    jsonl = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    files = {"file": ("dataset", jsonl, "application/octet-stream"), "params": (None, json.dumps(args), "application/json")}
    response = client.post("/v1/megatron/train", files=files)
    assert response.status_code == 200, response.text
    return response.json()["job_status"]["job_id"]


def wait_for(client: TestClient, job_id: str, states: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        body = client.get(f"/v1/megatron/train/{job_id}").json()
        if body["job_status"]["status"] in states:
            return body
        time.sleep(0.5)
    logs = client.get(f"/v1/megatron/train/{job_id}/logs").text
    pytest.fail(f"job {job_id} not in {states} after {timeout}s: {body}\nlogs:\n{logs[-3000:]}")


def test_training_job_on_slurm_completes_and_publishes(slurm_cluster, slurm_client):
    job_id = submit(slurm_client, {**TRAIN_ARGS, "cpu_ranks": RANKS})
    job_root = Path(slurm_client.get(f"/v1/megatron/train/{job_id}").json()["job_status"]["job_directory"])
    record = read_record(JobDir(job_root))
    assert record is not None and record.launcher == "slurm"
    held = slurm_cluster.run("scontrol", "show", "job", record.launcher_id)
    assert "Comment=scalarlm-ci" in held, held  # the settings' sbatch options reached SLURM

    body = wait_for(slurm_client, job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=420)
    assert body["job_status"]["status"] == "COMPLETED", body

    # SLURM ran it: the sbatch script is in the job directory and SLURM's record says COMPLETED.
    assert f"#SBATCH --ntasks={RANKS}" in (job_root / "sbatch.sh").read_text()
    assert (job_root / "logs" / f"rank-{RANKS - 1}.log").is_file()
    assert slurm_cluster.wait_state(record.launcher_id, {"COMPLETED"}, timeout=60) == "COMPLETED"
    # A published checkpoint: checkpoints/latest names a complete step directory with its manifest.
    latest = (job_root / "checkpoints" / "latest").read_text().strip()
    step_dir = job_root / "checkpoints" / latest
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["job_id"] == job_id and manifest["step"] == 2
    assert any(step_dir.glob("*.safetensors"))
    (entry,) = [m for m in slurm_client.get("/v1/megatron/list_models").json()["models"] if m["name"] == job_id]
    assert entry["status"] == "COMPLETED" and entry["step"] == 2


def test_cancelled_slurm_job_saves_its_state_and_is_cancelled(slurm_cluster, slurm_client):
    """The ranks get SIGTERM and save their state before the job ends. A plain scancel signalled srun too, which
    answers by SIGKILLing every rank: the job ended CANCELLED with nothing saved. Steps of a second or more, so the
    cancel marker (checked between steps) is not what stops it first."""
    job_id = submit(slurm_client, {**TRAIN_ARGS, "max_steps": 100000, "steps_per_checkpoint": 100000,
                                   "gradient_accumulation_steps": 64})  # fmt: skip
    deadline = time.monotonic() + 300
    while slurm_client.get(f"/v1/megatron/train/{job_id}").json()["job_status"]["step"] < 1:  # a step to save
        assert time.monotonic() < deadline, slurm_client.get(f"/v1/megatron/train/{job_id}/logs").text[-3000:]
        time.sleep(0.5)

    response = slurm_client.post(f"/v1/megatron/cancel/{job_id}")
    assert response.status_code == 200, response.text

    body = wait_for(slurm_client, job_id, {"CANCELLED", "FAILED", "COMPLETED"}, timeout=120)
    assert body["job_status"]["status"] == "CANCELLED", body
    job_root = Path(body["job_status"]["job_directory"])
    saved = json.loads((job_root / "state" / "latest.json").read_text())
    assert saved["step"] >= 1 and (job_root / "state" / f"step-{saved['step']}" / "rank-0.pt").is_file(), saved
    record = read_record(JobDir(job_root))
    assert slurm_cluster.wait_state(record.launcher_id, {"CANCELLED", "COMPLETED"}, timeout=60) in {"CANCELLED",
                                                                                                   "COMPLETED"}


def _node_back(slurm_cluster, node: str) -> None:
    """Return the downed node to service (SLURM may already have, when its slurmd re-registered: then `resume` is
    refused as an invalid state, which is what we wanted anyway)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = slurm_cluster.run("sinfo", "-h", "-n", node, "-o", "%T").strip()
        if "idle" in state or "mix" in state or "alloc" in state:
            return
        if "down" in state or "drain" in state or "fail" in state:
            try:
                slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=resume")
            except RuntimeError as error:  # it came back between sinfo and scontrol
                if "Invalid node state" not in str(error):
                    raise
        time.sleep(0.5)
    pytest.fail(f"node {node} still {state} 60 s after resume; slurmctld log: {slurm_cluster.log_tail()}")


def test_a_lost_node_fails_the_job_with_the_reason_and_it_resumes(slurm_cluster, tiny_model_dir: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:  # fmt: skip
    """The trainer's host is lost mid-job (its node goes DOWN: SLURM signals and kills the job, NODE_FAIL, and does not
    requeue it): the job ends FAILED saying why (SLURM's NODE_FAIL, or the trainer's own "terminated by SIGTERM ...
    state saved" when SLURM's SIGTERM reached it first); once the node is back, resuming it continues from the saved
    state."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    settings = Settings(home=tmp_path / "home", model=str(tiny_model_dir),
                        training={"launcher": "slurm", "poll_seconds": 0.5, "resume": "none"})  # fmt: skip
    node = slurm_cluster.run("sinfo", "-h", "-o", "%N").strip()
    with TestClient(create_app(settings)) as client:
        job_id = submit(client, {**TRAIN_ARGS, "max_steps": 100000, "steps_per_checkpoint": 5})
        job = JobDir(Path(client.get(f"/v1/megatron/train/{job_id}").json()["job_status"]["job_directory"]))
        wait_for(client, job_id, {"RUNNING"}, timeout=300)
        first = read_record(job).launcher_id
        deadline = time.monotonic() + 300
        while not (job.state_dir / "latest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.5)  # a saved state to resume from (every 5 steps)
        try:
            slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=scalarlm-test-host-lost")
            assert slurm_cluster.wait_state(first, {"NODE_FAIL"}, timeout=120) == "NODE_FAIL"  # not requeued
            body = wait_for(client, job_id, {"FAILED", "COMPLETED", "CANCELLED"}, timeout=120)
            reason = body["job_status"]["reason"]
            assert body["job_status"]["status"] == "FAILED", body
            assert f"SLURM job {first} ended NODE_FAIL" in reason or "terminated by SIGTERM at step" in reason, reason
        finally:
            _node_back(slurm_cluster, node)
        assert client.post(f"/v1/megatron/resume/{job_id}").status_code == 200
        wait_for(client, job_id, {"RUNNING"}, timeout=300)
        assert read_record(job).launcher_id != first and job.read_status().resumes == 1
        assert "resuming from the state saved at step" in client.get(f"/v1/megatron/train/{job_id}/logs").text
        client.post(f"/v1/megatron/cancel/{job_id}")
        wait_for(client, job_id, {"CANCELLED", "FAILED", "COMPLETED"}, timeout=120)


def test_a_partition_slurm_lacks_is_refused_with_sbatchs_reason(slurm_cluster, tiny_model_dir: Path, tmp_path: Path,
                                                                monkeypatch) -> None:
    """sbatch_options naming a partition SLURM does not have: the submission answers 503 with sbatch's own reason,
    leaves no job behind, and the server keeps serving."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    home = tmp_path / "home"
    settings = Settings(home=home, model=str(tiny_model_dir),
                        training={"launcher": "slurm", "sbatch_options": ["--partition=no-such-partition"]})
    with TestClient(create_app(settings)) as client:
        jsonl = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
        files = {"file": ("dataset", jsonl, "application/octet-stream"),
                 "params": (None, json.dumps(TRAIN_ARGS), "application/json")}  # fmt: skip
        response = client.post("/v1/megatron/train", files=files)
        assert response.status_code == 503, response.text
        assert "invalid partition" in response.json()["error"]["message"].lower(), response.text
        assert list((home / "jobs").iterdir()) == []
        models = client.get("/v1/megatron/list_models")
        assert models.status_code == 200 and [m["kind"] for m in models.json()["models"]] == ["base"]
