"""SIGKILL mid-training through a real `scalarlm serve --role api` and the real trainer (LocalLauncher):

1. the control plane alone is killed: the trainer (its own session) keeps going, and the restarted
   control plane reports the job RUNNING with its step still advancing (resumed supervision);
2. control plane and trainer are killed together (a node crash): the restarted control plane reports
   the job FAILED with the reason, and every checkpoint it lists is complete and opens in transformers;
   a half-written `step-N.tmp` is never listed nor named by `latest`.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from scalarlm.checkpoint import JobDir
from scalarlm.launcher import read_record

from security_payloads import ROWS, dataset_archive
from security_serve import job_status, serve
from security_serve import wait_job as wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAIN_ARGS = {"max_steps": 100_000, "learning_rate": 1e-3, "adapter_type": "full", "steps_per_checkpoint": 3,
              "max_seq_len": 64, "dtype": "float32", "gpus": 0}  # fmt: skip


def test_sigkill_mid_training_then_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert len(ROWS) >= 1
    home = tmp_path / "home"
    args = ["--role", "api", "--model", str(tiny_model_dir)]
    with serve(args, home) as (url, server, _):
        # The SDK ships an ml/ program beside the data; it must never run.
        code = f"open({str(tmp_path / 'uploaded-code-ran')!r}, 'w').write('ran')\n".encode()
        files = {"file": ("dataset", dataset_archive(extra_code=code), "application/octet-stream"),
                 "params": (None, json.dumps(TRAIN_ARGS), "application/json")}
        reply = httpx.post(f"{url}/v1/megatron/train", files=files, timeout=120)
        assert reply.status_code == 200, reply.text
        job_id = reply.json()["job_status"]["job_id"]
        wait_for(url, job_id, lambda b: len(b["checkpoints"]) >= 1)
        server.send_signal(signal.SIGKILL)
        server.wait()
    job = JobDir(home / "jobs" / job_id)
    trainer_pid = read_record(job).pid

    # 1. Only the control plane died: the restarted one still sees the job running and advancing.
    with serve(args, home) as (url, server, _):
        before = job_status(url, job_id)["job_status"]
        assert before["status"] == "RUNNING", before
        wait_for(url, job_id, lambda b: b["job_status"]["step"] > before["step"] + 3)
        wait_for(url, job_id, lambda b: len(b["checkpoints"]) >= 2)
        # 2. A node crash: the trainer's whole process group and the control plane die at once.
        os.killpg(trainer_pid, signal.SIGKILL)
        server.send_signal(signal.SIGKILL)
        server.wait()

    # What a crash in the middle of publishing leaves: a half-written step directory under its .tmp name.
    torn = job.checkpoints_dir / "step-999999.tmp"
    torn.mkdir()
    (torn / "config.json").write_text("{")
    with serve(args, home) as (url, _, _):
        body = wait_for(url, job_id, lambda b: b["job_status"]["status"] != "RUNNING", timeout=60)
        models = httpx.get(f"{url}/v1/megatron/list_models", timeout=30).json()["models"]
    (entry,) = [m for m in models if m["name"] == job_id]
    assert entry["version"] == max(body["checkpoints"]) < 999999  # the torn step is never served
    status = body["job_status"]
    assert status["status"] == "FAILED" and "without a final status" in status["reason"], status
    listed = body["checkpoints"]
    assert len(listed) >= 2 and all(isinstance(step, int) for step in listed)
    latest = (job.checkpoints_dir / "latest").read_text().strip()
    assert latest == f"step-{max(listed)}"
    for step in listed:
        model = AutoModelForCausalLM.from_pretrained(job.step_dir(step), dtype="float32")
        assert model.config.num_hidden_layers >= 1
    assert not (tmp_path / "uploaded-code-ran").exists() and not (job.root / "ml").exists()
    on_disk = sorted(p.name for p in job.checkpoints_dir.iterdir())
    print(f"\ncrash: checkpoints listed {listed}, on disk {on_disk}, reason {status['reason']!r}")
