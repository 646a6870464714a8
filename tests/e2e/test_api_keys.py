"""API keys end to end: the client sends its key as a Bearer token; a missing or wrong key is Unauthorized.

Runs a control plane alone (`serve --role api`, no engine: the queue answers without one), so it is cheap.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import scalarlm
from scalarlm.protocol.errors import Unauthorized

KEY = "e2e-secret"


@pytest.fixture(scope="module")
def keyed_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp_path = tmp_path_factory.mktemp("api-keys")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "scalarlm.cli", "serve", "--role", "api", "--model", str(tiny_model_dir),
               "--home", str(tmp_path / "home"), "--port", str(port), "--worker-url", "http://127.0.0.1:9"]
    log = tmp_path / "api.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "SCALARLM_API_KEYS": f"other,{KEY}"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/v1/health", timeout=2).json()["api"] == "up":
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"control plane did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_key_from_argument_or_env_is_accepted(keyed_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with scalarlm.ScalarLM(keyed_url, api_key=KEY) as llm:
        assert len(llm.submit_generate(["Hello", "World"], max_tokens=2)) == 2
        assert llm.metrics()["queue"]["queued"] >= 2
    monkeypatch.setenv("SCALARLM_API_KEY", KEY)
    with scalarlm.ScalarLM(keyed_url) as llm:
        assert llm.metrics()["queue_depth"] >= 2


def test_missing_or_wrong_key_is_unauthorized(keyed_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCALARLM_API_KEY", raising=False)
    with scalarlm.ScalarLM(keyed_url) as llm, pytest.raises(Unauthorized):
        llm.generate(["Hello"], max_tokens=2)
    with scalarlm.ScalarLM(keyed_url, api_key="wrong") as llm, pytest.raises(Unauthorized):
        llm.submit_generate(["Hello"])
    with scalarlm.ScalarLM(keyed_url) as llm:
        assert llm.health()["api"] == "up"  # health stays open for probes
