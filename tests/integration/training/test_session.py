"""RL session mode through `python -m scalarlm.training <job_dir>`: the test writes request files as the control
plane would. Each good batch takes one GRPO step and publishes the next version (with a notice POSTed to
$SCALARLM_NOTIFY_URL); a bad batch gets an error result and the session goes on; `end` completes it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from trainer_jobs import SessionTrainer, mpi_env, trainer_output, wait_for

from scalarlm.checkpoint import JobDir, latest_step, read_manifest
from scalarlm.checkpoint.session import SessionDir
from scalarlm.protocol.training import TrainArgs, TrainJobConfig

ARGS = dict(adapter_type="full", loss="grpo", kl_coef=0.01, learning_rate=1e-3, lr_schedule="constant", max_seq_len=64)


class Notices(BaseHTTPRequestHandler):
    received: list[tuple[str, str | None, dict]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Notices.received.append((self.path, self.headers.get("Authorization"), body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def notify_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Notices)
    Notices.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _rows(step: int) -> list[dict]:
    """Two groups of scored completions (one with equal rewards)."""
    return [
        {"prompt": "2+2=", "completion": "4", "reward": 1.0, "logprobs": [-1.0, -0.5]},
        {"prompt": "2+2=", "completion": "5", "reward": 0.0},
        {"prompt": "2+2=", "completion": "four", "reward": 0.5},
        {"prompt": "3+3=", "completion": str(step), "reward": 1.0, "group": "g3"},
        {"prompt": "3+3=", "completion": "6", "reward": 1.0, "group": "g3"},
    ]


def test_session_steps_publish_versions_until_end(tmp_path: Path, tiny_model_dir: Path, notify_server: str) -> None:
    job = JobDir(tmp_path / "session-1")
    job.create()
    job.write_config(TrainJobConfig(job_id=job.job_id, base_model=str(tiny_model_dir), train_args=TrainArgs(**ARGS),
                                    session=True))  # fmt: skip
    job.dataset_path.write_text("")
    files = SessionDir(job)
    files.create()
    env = {**mpi_env(), "SCALARLM_NOTIFY_URL": notify_server, "SCALARLM_NOTIFY_KEY": "sekret"}
    with SessionTrainer(job, env) as trainer:
        proc = trainer.proc
        results = {}
        batches = {1: _rows(1), 2: [{"prompt": "x", "completion": "y"}], 3: _rows(3), 4: _rows(4)}
        for k, rows in batches.items():
            files.write_request(k, rows)
            wait_for(lambda: files.result_path(k).exists() or proc.poll() is not None, 300, f"result {k}")
            assert files.result_path(k).exists(), trainer_output(job)
            results[k] = files.read_result(k)
        assert job.read_status().status == "RUNNING" and job.read_status().step == 3

        bad = results[2]
        assert bad.error and "reward" in bad.error and bad.version == 1
        assert [(r.step, r.version) for k, r in sorted(results.items()) if k != 2] == [(1, 1), (2, 2), (3, 3)]
        for k in (1, 3, 4):
            m = results[k].metrics
            assert results[k].error is None and results[k].loss is not None
            assert m["reward_mean"] == pytest.approx(0.7) and m["groups"] == 2 and "kl" in m and "clip_fraction" in m
        assert latest_step(job) == 3
        assert [read_manifest(job, s).kind for s in (1, 2, 3)] == ["full"] * 3
        assert (job.step_dir(3) / "model.safetensors").exists() and (job.step_dir(3) / "config.json").exists()
        assert (job.step_dir(1) / "model.safetensors").read_bytes() != (job.step_dir(3) / "model.safetensors").read_bytes()
    status = job.read_status()
    assert status.status == "COMPLETED" and status.step == 3, status
    assert [r["step"] for r in job.read_metrics()] == [1, 2, 3]
    assert [(p, auth, body) for p, auth, body in Notices.received] == [
        ("/v1/internal/published", "Bearer sekret", {"job_id": "session-1", "step": s}) for s in (1, 2, 3)
    ]


def test_a_session_saves_its_state_and_resumes_past_its_newest_version(tmp_path: Path, tiny_model_dir: Path) -> None:
    """State is saved every `steps_per_checkpoint` steps; a trainer killed after later steps resumes from that state
    and publishes the version after its newest one, never a published step again with other weights."""
    job = JobDir(tmp_path / "session-kill")
    job.create()
    args = TrainArgs(**{**ARGS, "kl_coef": 0.0, "steps_per_checkpoint": 2})
    job.write_config(TrainJobConfig(job_id=job.job_id, base_model=str(tiny_model_dir), train_args=args, session=True))
    job.dataset_path.write_text("")
    files = SessionDir(job)
    files.create()

    def serve(trainer: SessionTrainer, k: int) -> int:
        files.write_request(k, _rows(k))
        wait_for(lambda: files.result_path(k).exists() or trainer.proc.poll() is not None, 300, f"result {k}")
        assert files.result_path(k).exists(), trainer_output(job)
        return files.read_result(k).version

    with SessionTrainer(job) as trainer:
        assert [serve(trainer, k) for k in (1, 2, 3)] == [1, 2, 3]
        wait_for(lambda: json.loads((job.state_dir / "latest.json").read_text())["step"] == 2, 60, "state at step 2")
        wait_for(lambda: latest_step(job) == 3, 60, "step 3 landed")
        step3 = (job.step_dir(3) / "model.safetensors").read_bytes()
        trainer.kill()  # dies between two saves: step 3 is published, its state is not
        trainer.start()
        assert serve(trainer, 4) == 4  # from the state at step 2, published as the version after 3
        assert (job.step_dir(3) / "model.safetensors").read_bytes() == step3
        wait_for(lambda: json.loads((job.state_dir / "latest.json").read_text())["step"] == 4, 60, "state at 4")
        assert "the 1 step(s) between are lost, and its next step is version 4" in trainer_output(job)
    assert latest_step(job) == 4
