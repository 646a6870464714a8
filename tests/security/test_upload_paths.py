"""Upload hardening on the real app: size limits answer 413 on every upload route, names that could
escape `$SCALARLM_HOME` are refused on every route taking one, and a public listener without keys is
refused at start. (Crafted tars - absolute paths, `..`, links, devices - are covered route by route in
tests/integration/training_api/test_train_routes.py::test_unsafe_archives_are_400.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from scalarlm.config import Settings
from scalarlm.server.app import create_app

from security_payloads import dataset_archive

LIMIT = 64 * 1024


@pytest.fixture
def client(tmp_path: Path, tiny_model_dir: Path) -> Iterator[TestClient]:
    settings = Settings(home=tmp_path / "home", model=str(tiny_model_dir), server={"role": "api"},
                        upload={"max_upload_bytes": LIMIT, "max_request_bytes": LIMIT, "max_chunk_bytes": 4096})
    with TestClient(create_app(settings)) as c:
        yield c


def test_every_upload_route_answers_413_past_its_limit(client: TestClient) -> None:
    big = b"x" * (LIMIT + 1)
    answers = {
        "/v1/megatron/train": client.post("/v1/megatron/train", files={"file": ("d", big)}),
        "/v1/train": client.post("/v1/train", files={"file": ("d", big)}),
        "/v1/generate/upload": client.post("/v1/generate/upload", files={"file": ("p.json", big)}),
        "/v1/generate": client.post("/v1/generate", content=big, headers={"content-type": "application/json"}),
        "/v1/megatron/upload/chunk": client.post(
            "/v1/megatron/upload/chunk", content=b"y" * 5000,
            headers={"X-Upload-Id": "0" * 32, "X-Chunk-Index": "0"}),
    }
    for path, reply in answers.items():
        assert reply.status_code == 413, (path, reply.status_code, reply.text[:200])
        assert reply.json()["error"]["code"] == 413


ESCAPES = ["..", "../../etc", "..%2F..%2Fetc%2Fpasswd", "%2e%2e", "job-1%00", "a" * 200, ".hidden"]


@pytest.mark.parametrize("name", ESCAPES)
def test_names_that_could_escape_home_are_refused(client: TestClient, name: str, tmp_path: Path) -> None:
    for method, path in [("get", "/v1/megatron/train/{}"), ("get", "/v1/megatron/train/{}/metrics"),
                         ("get", "/v1/megatron/train/{}/logs"), ("post", "/v1/megatron/cancel/{}"),
                         ("post", "/v1/megatron/delete/{}")]:
        reply = getattr(client, method)(path.format(name))
        assert reply.status_code in (400, 404, 405), (path, name, reply.status_code)
    chunk = client.post("/v1/megatron/upload/chunk", content=b"z",
                        headers={"X-Upload-Id": name, "X-Chunk-Index": "0"})
    assert chunk.status_code in (400, 404)
    train = client.post("/v1/megatron/train", files={"file": ("d", dataset_archive())},
                        data={"params": json.dumps({"llm_name": f"../{name}", "max_steps": 1})})
    assert train.status_code == 400, train.text
    assert not (tmp_path / "etc").exists() and not any(tmp_path.glob("**/passwd"))


def test_public_listener_without_keys_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("SCALARLM_API_KEYS", "SCALARLM_API_KEYS_FILE")}
    command = [sys.executable, "-m", "scalarlm.cli", "serve", "--role", "api", "--model", str(tiny_model_dir),
               "--home", str(tmp_path / "home"), "--host", "0.0.0.0", "--port", "0"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "refusing to listen on 0.0.0.0 without API keys" in run.stdout + run.stderr
