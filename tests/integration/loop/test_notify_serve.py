"""A real `scalarlm serve --role api --port <p>` with API keys on, and a real training job: the trainer announces each
published step to that port with the control plane's internal notify key, and the server accepts it (200, counted in
/metrics) while its file poll is far too slow to have found the steps."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import scalarlm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROWS = [{"input": "Capital of France?", "output": " Paris"}, {"input": "Two plus two?", "output": " four"}]
TRAIN_ARGS = {"max_steps": 2, "steps_per_checkpoint": 1, "learning_rate": 1e-3, "adapter_type": "full",
              "max_seq_len": 64, "dtype": "float32", "gpus": 0}  # fmt: skip
KEY = "operator-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def published_answers(metrics: str) -> dict[str, float]:
    """POST /v1/internal/published answers by status code, from the Prometheus text."""
    pattern = r'scalarlm_http_requests_total\{([^}]*)\} ([0-9.e+]+)'
    counts = {}
    for labels, value in re.findall(pattern, metrics):
        if 'route="/v1/internal/published"' in labels:
            counts[re.search(r'status="(\d+)"', labels).group(1)] = float(value)
    return counts


def test_trainer_notice_reaches_an_api_server_on_its_own_port(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    env = {**os.environ, "SCALARLM_API_KEYS": KEY, "SCALARLM_TRAINING__POLL_SECONDS": "3600"}
    command = [sys.executable, "-m", "scalarlm.cli", "serve", "--role", "api", "--model", str(tiny_model_dir),
               "--home", str(tmp_path / "home"), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(f"{url}/v1/health", timeout=5).json().get("api") == "up":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.3)

        llm = scalarlm.ScalarLM(api_url=url, api_key=KEY, timeout=120)
        job = llm.train(ROWS, train_args=TRAIN_ARGS)
        final = job.wait(timeout=420)
        assert final.status == "COMPLETED", llm.get_training_job(job.id).info()

        answers = published_answers(httpx.get(f"{url}/metrics", timeout=30).text)
        assert answers == {"200": 2.0}, answers  # one notice per published step, none refused (401/403)
        # The catalog polls files once an hour here: only the notices can have told it of the steps. Workers learn
        # versions from get_work replies.
        work = httpx.post(f"{url}/v1/generate/get_work", json={"capacity": 0},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()  # fmt: skip
        assert {m["name"]: m["version"] for m in work["models"]}[job.id] == 2
        key = (tmp_path / "home" / "internal" / "notify.key").read_text().strip()
        assert key not in log.read_text() and key not in llm.get_training_job(job.id).info().model_dump_json()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
