"""The real control-plane app (TestClient, real files under tmp_path) with a quick stand-in trainer program.

The routes, validation, job registry and LocalLauncher are the real ones; only the program the launcher
starts is a 20-line script that follows the trainer's file contract, so these tests take seconds.
`test_real_training.py` runs the real trainer.
"""

from __future__ import annotations

import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from scalarlm.config import Settings
from scalarlm.launcher import LocalLauncher
from scalarlm.server.app import create_app
from scalarlm.server.jobs import TrainingJobs

from sdk_payloads import STAND_IN_TRAINER  # helper module next to this file


@pytest.fixture
def settings(tmp_path: Path, tiny_model_dir: Path) -> Settings:
    return Settings(home=tmp_path / "home", model=str(tiny_model_dir), training={"poll_seconds": 0.2},
                    upload={"max_chunk_bytes": 4096, "max_upload_bytes": 1 << 20})  # fmt: skip


@pytest.fixture
def client(settings: Settings, tmp_path: Path) -> Iterator[TestClient]:
    trainer = tmp_path / "stand_in_trainer.py"
    trainer.write_text(textwrap.dedent(STAND_IN_TRAINER))
    app = create_app(settings)
    app.state.training = TrainingJobs(settings, {"local": LocalLauncher(settings, entry=[str(trainer)])})
    with TestClient(app) as c:
        yield c


@pytest.fixture
def wait_status():
    """wait_status(client, job_id, states, timeout) -> the job body once its status is in `states`."""

    def wait(client: TestClient, job_id: str, states=("COMPLETED", "FAILED", "CANCELLED"), timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            body = client.get(f"/v1/megatron/train/{job_id}").json()
            if body["job_status"]["status"] in states or time.monotonic() > deadline:
                return body
            time.sleep(0.1)

    return wait


@pytest.fixture
def live_url(settings: Settings, tmp_path: Path) -> Iterator[str]:
    """A real uvicorn server (in a thread) running the app with the stand-in trainer; yields its URL."""
    trainer = tmp_path / "stand_in_trainer.py"
    trainer.write_text(textwrap.dedent(STAND_IN_TRAINER))
    app = create_app(settings)
    app.state.training = TrainingJobs(settings, {"local": LocalLauncher(settings, entry=[str(trainer)])})
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the control plane did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)
