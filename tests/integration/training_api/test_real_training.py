"""The real trainer (`python -m scalarlm.training`, megatron-core on CPU) through the real server and LocalLauncher."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from scalarlm.checkpoint import JobDir
from scalarlm.config import Settings
from scalarlm.launcher import read_record
from scalarlm.server.app import create_app

from sdk_payloads import post_train, sdk_archive  # helper module next to this file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# A memorisation set: four short question -> answer pairs.
MEMORISE = [
    {"input": "Capital of France?", "output": " Paris"},
    {"input": "Two plus two?", "output": " four"},
    {"input": "Colour of the sky?", "output": " blue"},
    {"input": "Opposite of hot?", "output": " cold"},
]
TRAIN_ARGS = {"max_steps": 30, "learning_rate": 1e-2, "adapter_type": "full", "steps_per_checkpoint": 30,
              "max_seq_len": 64, "dtype": "float32", "gpus": 0}  # fmt: skip
LOSS_THRESHOLD = 0.1  # the first step is ~6.6 (random tiny model); 30 steps reach ~0.002 here


@pytest.fixture
def real_client(tmp_path: Path, tiny_model_dir: Path) -> Iterator[TestClient]:
    settings = Settings(home=tmp_path / "home", model=str(tiny_model_dir), training={"poll_seconds": 0.5})
    with TestClient(create_app(settings)) as client:
        yield client


def wait_done(client: TestClient, job_id: str, until, timeout: float = 420.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/megatron/train/{job_id}").json()
        if until(body["job_status"]):
            return body
        if time.monotonic() > deadline:
            logs = client.get(f"/v1/megatron/train/{job_id}/logs").text
            pytest.fail(f"job {job_id} still {body['job_status']} after {timeout}s\n{logs[-3000:]}")
        time.sleep(0.5)


def test_sft_job_memorises_and_its_checkpoint_opens_in_transformers(real_client, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    response = post_train(real_client, sdk_archive(MEMORISE), TRAIN_ARGS)
    assert response.status_code == 200, response.text
    job_id = response.json()["job_status"]["job_id"]

    body = wait_done(real_client, job_id, lambda s: s["status"] in ("COMPLETED", "FAILED", "CANCELLED"))
    logs = real_client.get(f"/v1/megatron/train/{job_id}/logs").text
    assert body["job_status"]["status"] == "COMPLETED", logs[-3000:]
    metrics = real_client.get(f"/v1/megatron/train/{job_id}/metrics").json()
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert metrics[-1]["loss"] < LOSS_THRESHOLD < metrics[0]["loss"]
    assert body["checkpoints"] == [30]
    (entry,) = [m for m in real_client.get("/v1/megatron/list_models").json()["models"] if m["name"] == job_id]
    assert (entry["status"], entry["kind"], entry["deployed"], entry["version"]) == ("COMPLETED", "full", True, 30)

    step_dir = Path(body["job_status"]["job_directory"]) / "checkpoints" / "step-30"
    model = AutoModelForCausalLM.from_pretrained(step_dir, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    row = MEMORISE[0]
    prompt = tokenizer(row["input"], return_tensors="pt")
    answer = tokenizer(row["output"], add_special_tokens=False)["input_ids"]
    out = model.generate(**prompt, max_new_tokens=len(answer), do_sample=False)
    assert out[0, prompt["input_ids"].shape[1] :].tolist() == answer

    # A job trained from this one's step keeps that base when this job is gone (deleted, or its steps pruned).
    chained = post_train(real_client, sdk_archive(MEMORISE), {**TRAIN_ARGS, "max_steps": 2, "llm_name": job_id,
                                                               "steps_per_checkpoint": 2})  # fmt: skip
    assert chained.status_code == 200, chained.text
    chained_id = chained.json()["job_status"]["job_id"]
    base = Path(chained.json()["job_config"]["base_model"])
    assert base == Path(chained.json()["job_status"]["job_directory"]) / "base"
    assert (base / "model.safetensors").stat().st_ino == (step_dir / "model.safetensors").stat().st_ino  # a link
    assert real_client.post(f"/v1/megatron/delete/{job_id}").json()["deleted"] is True
    body = wait_done(real_client, chained_id, lambda s: s["status"] in ("COMPLETED", "FAILED", "CANCELLED"))
    assert body["job_status"]["status"] == "COMPLETED", real_client.get(f"/v1/megatron/train/{chained_id}/logs").text
    first = real_client.get(f"/v1/megatron/train/{chained_id}/metrics").json()[0]
    assert first["loss"] < LOSS_THRESHOLD and body["checkpoints"] == [2]  # it started from the memorised weights


def test_killed_trainer_is_failed_with_the_reason(real_client):
    job_id = post_train(real_client, sdk_archive(MEMORISE), {**TRAIN_ARGS, "max_steps": 100_000}).json()[
        "job_status"
    ]["job_id"]
    wait_done(real_client, job_id, lambda s: s["status"] == "RUNNING" and s["step"] >= 2)
    job_root = Path(real_client.get(f"/v1/megatron/train/{job_id}").json()["job_status"]["job_directory"])
    pid = read_record(JobDir(job_root)).pid

    os.killpg(pid, signal.SIGKILL)  # the trainer dies without a chance to write its status

    status = wait_done(real_client, job_id, lambda s: s["status"] != "RUNNING", timeout=60)["job_status"]
    assert status["status"] == "FAILED"
    assert status["reason"].startswith(f"trainer process {pid} was killed by SIGKILL without a final status; last step ")


def test_two_cpu_ranks_run_under_mpirun(real_client):
    """cpu_ranks=2: the LocalLauncher starts `mpirun -n 2` (root-safe env) and both ranks train and log."""
    response = post_train(real_client, sdk_archive(MEMORISE), {**TRAIN_ARGS, "max_steps": 2, "cpu_ranks": 2})
    assert response.status_code == 200, response.text
    job_id = response.json()["job_status"]["job_id"]
    body = wait_done(real_client, job_id, lambda s: s["status"] in ("COMPLETED", "FAILED", "CANCELLED"))
    job_root = Path(body["job_status"]["job_directory"])
    assert body["job_status"]["status"] == "COMPLETED", real_client.get(f"/v1/megatron/train/{job_id}/logs").text
    assert read_record(JobDir(job_root)).command[1:3] == ["-n", "2"]
    assert (job_root / "logs" / "rank-1.log").is_file()


def test_time_limit_saves_state_and_fails_the_job_saying_so(real_client):
    """`timeout` holds on the local launcher too: past it the trainer saves at a step boundary and ends FAILED."""
    job_id = post_train(real_client, sdk_archive(MEMORISE), {**TRAIN_ARGS, "max_steps": 100_000, "timeout": 25}).json()[
        "job_status"
    ]["job_id"]
    started = time.monotonic()
    status = wait_done(real_client, job_id, lambda s: s["status"] in ("COMPLETED", "FAILED", "CANCELLED"))["job_status"]
    assert status["status"] == "FAILED"
    assert status["reason"].startswith(f"stopped at step {status['step']}: the time limit of 25 s"), status["reason"]
    assert 25 <= time.monotonic() - started < 120
    state = JobDir(Path(status["job_directory"])).root / "state" / "latest.json"
    assert __import__("json").loads(state.read_text())["step"] == status["step"] > 0
