"""SIGTERM to a real `scalarlm serve --role api` while the real trainer (LocalLauncher) runs a job:

1. the control plane drains, asks the trainer to save its state, and exits within its bound; the job waits
   QUEUED with its saved state and intact checkpoints;
2. the restarted control plane resumes it from that state (steps continue, none trained twice in the metrics);
3. a cancelled job is resumed by hand (POST /v1/megatron/resume/<id>; 409 while it runs);
4. with `training.resume=all`, a trainer killed together with its control plane (a node crash) is resumed too.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from scalarlm.checkpoint import JobDir
from scalarlm.launcher import read_record
from scalarlm.launcher.process import is_alive

from security_payloads import dataset_archive
from security_serve import job_status, serve, wait_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAIN_ARGS = {"max_steps": 100_000, "learning_rate": 1e-3, "adapter_type": "full", "steps_per_checkpoint": 3,
              "max_seq_len": 64, "dtype": "float32", "gpus": 0}  # fmt: skip
DRAIN_SECONDS, GRACE_SECONDS = 10, 60
ENV = {"SCALARLM_SERVER__SHUTDOWN_SECONDS": str(DRAIN_SECONDS), "SCALARLM_TRAINING__STOP_GRACE_SECONDS": str(GRACE_SECONDS)}


def saved_step(job: JobDir) -> int:
    return json.loads((job.state_dir / "latest.json").read_text())["step"]


def metric_steps(job: JobDir) -> list[int]:
    return [row["step"] for row in job.read_metrics()]


def test_sigterm_checkpoints_the_trainer_and_restart_resumes_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    home = tmp_path / "home"
    args = ["--role", "api", "--model", str(tiny_model_dir)]
    with serve(args, home, ENV) as (url, server, log):
        files = {"file": ("dataset", dataset_archive(), "application/octet-stream"),
                 "params": (None, json.dumps(TRAIN_ARGS), "application/json")}
        reply = httpx.post(f"{url}/v1/megatron/train", files=files, timeout=120)
        assert reply.status_code == 200, reply.text
        job_id = reply.json()["job_status"]["job_id"]
        wait_job(url, job_id, lambda b: len(b["checkpoints"]) >= 1 and b["job_status"]["step"] >= 4)
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=DRAIN_SECONDS + GRACE_SECONDS + 60)
        took = time.monotonic() - started
    job = JobDir(home / "jobs" / job_id)
    record = read_record(job)

    # 1. Exited cleanly within drain + grace; the trainer saved its state and stopped, the job waits QUEUED.
    assert code == 0, log.read_text()[-3000:]
    assert took < DRAIN_SECONDS + GRACE_SECONDS + 30
    assert not is_alive(record.pid, record.start_ticks)
    status = job.read_status()
    assert status.status == "QUEUED", status
    assert f"stopped at step {status.step} by the control plane's shutdown; state saved" in status.reason
    stopped_at = saved_step(job)
    assert stopped_at == status.step >= 4 and metric_steps(job) == list(range(1, stopped_at + 1))
    latest = int((job.checkpoints_dir / "latest").read_text().strip().removeprefix("step-"))
    assert AutoModelForCausalLM.from_pretrained(job.step_dir(latest), dtype="float32").config.num_hidden_layers >= 1
    print(f"\nshutdown: exit {code} after {took:.1f} s (bound {DRAIN_SECONDS}+{GRACE_SECONDS} s), state step {stopped_at}")

    with serve(args, home, ENV) as (url, server, _):
        # 2. The restarted control plane resumes the job from the saved step.
        body = wait_job(url, job_id, lambda b: b["job_status"]["step"] >= stopped_at + 3)
        assert body["job_status"]["status"] == "RUNNING" and body["job_status"]["resumes"] == 1
        steps = metric_steps(job)
        assert steps[: stopped_at + 3] == list(range(1, stopped_at + 4)), steps  # continued, not restarted
        assert read_record(job).pid != record.pid

        # 3. Resume by hand: 409 while it runs; a cancelled job continues from its saved state.
        conflict = httpx.post(f"{url}/v1/megatron/resume/{job_id}", timeout=30)
        assert conflict.status_code == 409 and "RUNNING" in conflict.json()["error"]["message"]
        missing = httpx.post(f"{url}/v1/megatron/resume/job-does-not-exist", timeout=30)
        assert missing.status_code == 404
        cancelled = httpx.post(f"{url}/v1/megatron/cancel/{job_id}", timeout=120).json()
        assert cancelled["status"] == "CANCELLED", cancelled
        at_cancel = saved_step(job)
        resumed = httpx.post(f"{url}/v1/megatron/resume/{job_id}", timeout=60)
        assert resumed.status_code == 200, resumed.text
        assert resumed.json()["resumes"] == 2
        assert resumed.json()["reason"].startswith(f"resuming from the state saved at step {at_cancel}")
        wait_job(url, job_id, lambda b: b["job_status"]["status"] == "RUNNING" and b["job_status"]["step"] > at_cancel)

        # 4. A node crash: trainer and control plane die together.
        trainer = read_record(job).pid
        wait_job(url, job_id, lambda b: len(b["checkpoints"]) >= 2)
        os.killpg(trainer, signal.SIGKILL)
        server.send_signal(signal.SIGKILL)
        server.wait()
    crashed_at = saved_step(job)

    with serve(args, home, {**ENV, "SCALARLM_TRAINING__RESUME": "all"}) as (url, _, _):
        body = wait_job(url, job_id, lambda b: b["job_status"]["resumes"] == 3 and b["job_status"]["status"] == "RUNNING"
                        and b["job_status"]["step"] > crashed_at)  # fmt: skip
        assert "reason" in body["job_status"]
        log_text = httpx.get(f"{url}/v1/megatron/train/{job_id}/logs", timeout=30).text
        assert f"resuming from the state saved at step {crashed_at}: the trainer crashed" in log_text
        httpx.post(f"{url}/v1/megatron/cancel/{job_id}", timeout=120)
    steps = metric_steps(job)
    assert steps == list(range(1, len(steps) + 1)), steps  # every step once, in order, across four trainers
