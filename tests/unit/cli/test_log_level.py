"""`log_level`: what `scalarlm serve` writes to its log follows it (any case); a level that does not exist is refused
when the settings load, naming the field."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from scalarlm.config import Settings, load_settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_log(tmp_path: Path, model: Path, level: str) -> str:
    """Everything `scalarlm serve --role api` logs from start to an answered /v1/health and a SIGTERM exit."""
    port = _free_port()
    env = {**os.environ, "SCALARLM_LOG_LEVEL": level}
    command = [sys.executable, "-m", "scalarlm.cli.main", "serve", "--role", "api", "--port", str(port),
               "--home", str(tmp_path / level), "--model", str(model)]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code < 500:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the api did not come up"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    return out


def test_serve_logs_at_the_configured_level(tmp_path: Path, tiny_model_dir: Path) -> None:
    info = _serve_log(tmp_path, tiny_model_dir, "info")
    assert "serving " in info and "Application startup complete" in info  # our INFO line and uvicorn's
    assert "GET /v1/health HTTP/1.1" in info  # uvicorn's access log
    quiet = _serve_log(tmp_path, tiny_model_dir, "WARNING")
    assert "serving " not in quiet and "Application startup complete" not in quiet and "GET /v1/health" not in quiet, quiet


def test_an_unknown_level_is_refused_naming_log_level() -> None:
    assert Settings(log_level="debug").log_level == "DEBUG"
    with pytest.raises(ValidationError) as refused:
        load_settings(log_level="verbose")
    assert "log_level" in str(refused.value)
