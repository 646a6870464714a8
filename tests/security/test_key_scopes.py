"""API keys on the real control-plane app (real SQLite queue, real LocalLauncher): hashed at rest,
scoped (generate / train / admin), per-key limits answering 429 with Retry-After."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from scalarlm.config import Settings
from scalarlm.launcher import LocalLauncher
from scalarlm.server.app import create_app
from scalarlm.server.auth import KeyFileError, KeyRing
from scalarlm.server.jobs import TrainingJobs
from scalarlm.server.sessions import RLSessions

from security_payloads import LONG_TRAINER, dataset_archive

FULL, GEN, TRAIN, ADMIN, LIMITED = "full-key-1", "gen-key-2", "train-key-3", "admin-key-4", "limited-key-5"
KEYS_FILE = f"""
# key  scopes  limits
{GEN} generate
{TRAIN} train max_jobs=1
{ADMIN} admin
{LIMITED} generate,train max_queued=3
"""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[TestClient, Settings]]:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(KEYS_FILE)
    settings = Settings(home=tmp_path / "home", model=str(tiny_model_dir),
                        server={"api_keys": [FULL], "api_keys_file": keys_file, "role": "api"},
                        training={"poll_seconds": 0.2})  # fmt: skip
    trainer = tmp_path / "trainer.py"
    trainer.write_text(LONG_TRAINER)
    app = create_app(settings)
    app.state.training = TrainingJobs(settings, {"local": LocalLauncher(settings, entry=[str(trainer)])})
    app.state.sessions = RLSessions(app.state.training, app.state.sessions.catalog)  # sessions launch it too
    with TestClient(app) as client:
        yield client, settings


# (method, path, body, scope the route needs)
ROUTES = [
    ("post", "/v1/generate", {"prompts": ["hi"]}, "generate"),
    ("post", "/v1/generate/get_results", {"request_ids": []}, "generate"),
    ("get", "/v1/generate/metrics", None, "generate"),
    ("post", "/v1/chat/completions", {"messages": []}, "generate"),
    ("get", "/v1/models", None, "generate"),
    ("get", "/v1/megatron/list_models", None, "train"),
    ("get", "/v1/megatron/gpu_count", None, "train"),
    ("get", "/v1/megatron/train/job-nope", None, "train"),
    ("post", "/v1/megatron/delete/job-nope", None, "train"),
    ("post", "/v1/generate/clear_queue", None, "admin"),
    ("post", "/v1/generate/get_work", {"capacity": 1}, "admin"),
    ("post", "/v1/generate/finish_work", {"results": []}, "admin"),
]
KEY_OF_SCOPE = {"generate": GEN, "train": TRAIN, "admin": ADMIN}


def call(client: TestClient, method: str, path: str, body: dict | None, key: str | None):
    headers = bearer(key) if key else {}
    if method == "get":
        return client.get(path, headers=headers)
    return client.post(path, json=body, headers=headers)


def test_every_route_needs_a_key_with_its_scope(keyed) -> None:
    client, _ = keyed
    for method, path, body, scope in ROUTES:
        assert call(client, method, path, body, None).status_code == 401, path
        wrong = call(client, method, path, body, "not-a-key")
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error", path
        for other_scope, key in KEY_OF_SCOPE.items():
            status = call(client, method, path, body, key).status_code
            if other_scope == scope:
                assert status not in (401, 403), (path, key, status)
            else:
                assert status == 403, (path, key, status)
        full = call(client, method, path, body, FULL)  # env keys hold every scope
        assert full.status_code not in (401, 403), path
    forbidden = call(client, "post", "/v1/generate/clear_queue", None, GEN)
    assert forbidden.json()["error"]["type"] == "permission_error" and "admin" in forbidden.json()["error"]["message"]
    assert client.get("/v1/health").status_code == 200  # probes need no key
    assert client.get("/metrics").status_code == 200


def test_keys_are_held_only_as_digests(keyed) -> None:
    client, _ = keyed
    ring: KeyRing = client.app.state.keys
    held = repr(vars(ring)) + "".join(key.digest.hex() for key in ring.keys)
    assert len(ring.keys) == 5
    for key in (FULL, GEN, TRAIN, ADMIN, LIMITED):
        assert key not in held and key.encode().hex() not in held


def test_bad_keys_file_refuses_to_start(tmp_path: Path) -> None:
    bad = tmp_path / "keys.txt"
    bad.write_text("k1 generate,root\n")
    with pytest.raises(KeyFileError, match="keys.txt:1: unknown scope"):
        KeyRing.load([], bad)
    bad.write_text("k1 max_queued=lots\n")
    with pytest.raises(KeyFileError, match="bad limit"):
        KeyRing.load([], bad)


def test_max_queued_answers_429_with_retry_after_until_items_finish(keyed) -> None:
    client, _ = keyed
    ok = client.post("/v1/generate", json={"prompts": ["a", "b"]}, headers=bearer(LIMITED))
    assert ok.status_code == 200
    over = client.post("/v1/generate", json={"prompts": ["c", "d"]}, headers=bearer(LIMITED))
    assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1
    assert over.json()["error"]["type"] == "rate_limit_error" or over.json()["error"]["code"] == 429
    too_big = client.post("/v1/generate", json={"prompts": list("abcd")}, headers=bearer(LIMITED))
    assert too_big.status_code == 400  # could never fit: not a retry case
    # Other keys are not limited by this key's queue.
    assert client.post("/v1/generate", json={"prompts": list("abcdef")}, headers=bearer(GEN)).status_code == 200
    # A worker (admin key) finishes everything; the limited key may queue again.
    while items := client.post("/v1/generate/get_work", json={"capacity": 64}, headers=bearer(ADMIN)).json()["requests"]:
        results = [{"request_id": i["request_id"], "model": i["model"], "outputs": [{"text": "x"}]} for i in items]
        assert client.post("/v1/generate/finish_work", json={"results": results}, headers=bearer(ADMIN)).status_code == 200
    assert client.post("/v1/generate", json={"prompts": ["c", "d"]}, headers=bearer(LIMITED)).status_code == 200


def _train(client: TestClient, key: str):
    files = {"file": ("dataset", dataset_archive(), "application/octet-stream"),
             "params": (None, json.dumps({"max_steps": 1000000}), "application/json")}
    return client.post("/v1/megatron/train", files=files, headers=bearer(key))


def _wait_terminal(client: TestClient, job_id: str, key: str) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = client.get(f"/v1/megatron/train/{job_id}", headers=bearer(key)).json()["job_status"]["status"]
        if status in ("COMPLETED", "FAILED", "CANCELLED"):
            return status
        time.sleep(0.1)
    raise AssertionError(f"{job_id} still running")


def test_max_jobs_answers_429_while_the_key_runs_its_limit(keyed) -> None:
    client, _ = keyed
    first = _train(client, TRAIN)
    assert first.status_code == 200, first.text
    job_id = first.json()["job_status"]["job_id"]
    second = _train(client, TRAIN)
    assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
    assert "limit is 1" in second.json()["error"]["message"]
    other = _train(client, FULL)  # another key is not held back
    assert other.status_code == 200
    for key, jid in ((TRAIN, job_id), (FULL, other.json()["job_status"]["job_id"])):
        assert client.post(f"/v1/megatron/cancel/{jid}", headers=bearer(key)).status_code == 200
        assert _wait_terminal(client, jid, key) == "CANCELLED"
    third = _train(client, TRAIN)  # the key's job ended: it may start another
    assert third.status_code == 200
    jid = third.json()["job_status"]["job_id"]
    client.post(f"/v1/megatron/cancel/{jid}", headers=bearer(TRAIN))
    _wait_terminal(client, jid, TRAIN)


def test_an_rl_session_counts_against_max_jobs_like_a_training_job(keyed) -> None:
    """A session is a trainer too (as is a Tinker training client, which is a session): with max_jobs=1 the key's
    second session, or a training job beside it, answers 429 until the session ends."""
    client, _ = keyed
    first = client.post("/v1/train/sessions", json={}, headers=bearer(TRAIN))
    assert first.status_code == 200, first.text
    session_id = first.json()["session_id"]
    second = client.post("/v1/train/sessions", json={}, headers=bearer(TRAIN))
    assert second.status_code == 429 and "limit is 1" in second.json()["error"]["message"]
    assert _train(client, TRAIN).status_code == 429
    other = client.post("/v1/train/sessions", json={}, headers=bearer(FULL))  # another key is not held back
    assert other.status_code == 200
    assert client.post(f"/v1/megatron/cancel/{session_id}", headers=bearer(TRAIN)).status_code == 200
    assert _wait_terminal(client, session_id, TRAIN) == "CANCELLED"
    again = client.post("/v1/train/sessions", json={}, headers=bearer(TRAIN))
    assert again.status_code == 200, again.text
    for sid in (again.json()["session_id"], other.json()["session_id"]):
        assert client.post(f"/v1/megatron/cancel/{sid}", headers=bearer(FULL)).status_code == 200
        assert _wait_terminal(client, sid, FULL) == "CANCELLED"


def test_per_key_counts_survive_a_restart_of_the_control_plane(keyed, tmp_path) -> None:
    """The key -> batch / job record is in SQLite beside the queue: a new app on the same home keeps the limits."""
    client, settings = keyed
    assert client.post("/v1/generate", json={"prompts": ["a", "b"]}, headers=bearer(LIMITED)).status_code == 200
    first = _train(client, TRAIN)
    assert first.status_code == 200, first.text
    job_id = first.json()["job_status"]["job_id"]
    trainer = tmp_path / "trainer.py"
    restarted = create_app(settings)  # another process would read the same files
    restarted.state.training = TrainingJobs(settings, {"local": LocalLauncher(settings, entry=[str(trainer)])})
    with TestClient(restarted) as again:
        over = again.post("/v1/generate", json={"prompts": ["c", "d"]}, headers=bearer(LIMITED))
        assert over.status_code == 429 and "2 unfinished items" in over.json()["error"]["message"]
        assert _train(again, TRAIN).status_code == 429  # its running job still counts
        assert again.post(f"/v1/megatron/cancel/{job_id}", headers=bearer(TRAIN)).status_code == 200
        assert _wait_terminal(again, job_id, TRAIN) == "CANCELLED"
        later = _train(again, TRAIN)
        assert later.status_code == 200
        again.post(f"/v1/megatron/cancel/{later.json()['job_status']['job_id']}", headers=bearer(TRAIN))
    assert (settings.home / "usage.sqlite").exists()
