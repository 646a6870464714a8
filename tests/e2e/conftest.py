"""One real `scalarlm serve` subprocess (control plane + in-process vLLM worker) for the e2e tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"scalarlm serve exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            if httpx.get(f"{url}/v1/health", timeout=5).json().get("all") == "up":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    pytest.fail(f"scalarlm serve not up after {STARTUP_TIMEOUT} s:\n{log.read_text()[-6000:]}")


@pytest.fixture(scope="session")
def server_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a running `scalarlm serve --model <tiny>` on a free loopback port."""
    tmp = tmp_path_factory.mktemp("e2e-server")
    port = _free_port()
    log = tmp / "server.log"
    command = [sys.executable, "-m", "scalarlm.cli", "serve", "--model", str(tiny_model_dir),
               "--home", str(tmp / "home"), "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, proc, log)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"scalarlm serve ignored SIGTERM for 60 s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def model_name(tiny_model_dir: Path) -> str:
    """The name the server gives the base model (the model directory's name)."""
    return tiny_model_dir.name
