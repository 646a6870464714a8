"""Chunked training upload exactly as the ScalarLM SDK's `_upload_chunked` does it: init, chunks, finalize."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time

from fastapi.testclient import TestClient

from scalarlm.server.app import create_app

from sdk_payloads import sdk_archive  # helper module next to this file

CHUNK = 1024


def big_rows(n: int = 60) -> list[dict]:
    rng = random.Random(0)  # incompressible-ish text so the archive spans several chunks
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8)) for _ in range(400)]
    return [{"input": " ".join(rng.choices(words, k=12)), "output": rng.choice(words)} for _ in range(n)]


def init(client, archive: bytes, params: dict, chunk_size: int = CHUNK):
    return client.post("/v1/megatron/upload/init", json={
        "total_size": len(archive), "total_hash": hashlib.sha256(archive).hexdigest(), "chunk_size": chunk_size,
        "num_chunks": -(-len(archive) // chunk_size), "compressed": True, "params": params,
    })  # fmt: skip


def send_chunk(client, upload_id: str, index: int, data: bytes, digest: str | None = None):
    return client.post("/v1/megatron/upload/chunk", content=data, headers={
        "X-Upload-Id": upload_id, "X-Chunk-Index": str(index),
        "X-Chunk-Hash": digest or hashlib.sha256(data).hexdigest(), "Content-Type": "application/octet-stream",
    })  # fmt: skip


def test_chunked_upload_resumes_and_starts_a_job(client, settings, wait_status):
    archive = sdk_archive(big_rows())
    chunks = [archive[i : i + CHUNK] for i in range(0, len(archive), CHUNK)]
    assert len(chunks) >= 3
    opened = init(client, archive, {"max_steps": 3})
    assert opened.status_code == 200, opened.text
    upload_id = opened.json()["upload_id"]
    assert opened.json()["received_chunks"] == []

    assert send_chunk(client, upload_id, 0, chunks[0]).status_code == 200
    bad = send_chunk(client, upload_id, 1, chunks[1], digest="0" * 64)
    assert bad.status_code == 422  # the SDK retries a chunk on 422
    # The client restarts: init again with the same archive resumes the session.
    again = init(client, archive, {"max_steps": 3}).json()
    assert again == {"upload_id": upload_id, "received_chunks": [0]}
    for index, data in enumerate(chunks[1:], start=1):
        assert send_chunk(client, upload_id, index, data).status_code == 200

    done = client.post("/v1/megatron/upload/finalize", json={"upload_id": upload_id})
    assert done.status_code == 200, done.text
    job_id = done.json()["job_status"]["job_id"]
    assert done.json()["job_config"]["dataset_rows"] == 60
    assert wait_status(client, job_id)["job_status"]["status"] == "COMPLETED"
    assert not list((settings.home / "uploads").iterdir())  # the session is cleaned up


def test_finalize_with_missing_chunks_is_400(client):
    archive = sdk_archive(big_rows())
    upload_id = init(client, archive, {}).json()["upload_id"]
    send_chunk(client, upload_id, 0, archive[:CHUNK])
    response = client.post("/v1/megatron/upload/finalize", json={"upload_id": upload_id})
    assert response.status_code == 400 and "missing chunks [1" in response.json()["error"]["message"]


def test_upload_limits_are_413(client, settings):
    too_big = settings.upload.max_upload_bytes + 1
    response = client.post("/v1/megatron/upload/init", json={
        "total_size": too_big, "total_hash": "a" * 64, "chunk_size": CHUNK, "num_chunks": -(-too_big // CHUNK),
    })  # fmt: skip
    assert response.status_code == 413
    big_chunk = settings.upload.max_chunk_bytes * 2
    assert init(client, b"x" * big_chunk, {}, chunk_size=big_chunk).status_code == 413
    single = client.post("/v1/megatron/train", files={"file": ("dataset", b"x" * (too_big + 10))})
    assert single.status_code == 413


def test_bad_train_args_fail_at_init_before_any_data_is_sent(client):
    response = init(client, sdk_archive(), {"max_steps": 3, "epochs": 2})
    assert response.status_code == 400 and "unknown train arg 'epochs'" in response.json()["error"]["message"]


def test_unknown_upload_is_404(client):
    assert client.post("/v1/megatron/upload/finalize", json={"upload_id": "f" * 32}).status_code == 404
    assert send_chunk(client, "nope", 0, b"x").status_code == 404
    assert json.loads(send_chunk(client, "nope", 0, b"x").text)["error"]["type"] == "not_found_error"


def test_an_upload_no_chunk_reaches_for_abandoned_upload_seconds_is_removed(settings, tmp_path):
    """The app's sweep (at start, then every half of the setting here) removes an upload whose client went away with
    its chunks; one whose client keeps sending stays and resumes; the same archive sent again starts over."""
    upload = settings.upload.model_copy(update={"abandoned_upload_seconds": 1.0})
    settings = settings.model_copy(update={"upload": upload})
    archive, other = sdk_archive(big_rows()), sdk_archive(big_rows(30))
    left = settings.home / "uploads" / ("chunked-" + "a" * 32)  # left by a client before a restart
    left.mkdir(parents=True)
    (left / "chunk-0").write_bytes(b"x")
    spooled = settings.home / "uploads" / "single-0123456789abcdef"  # a plain upload's spool, its process killed
    spooled.write_bytes(b"x")
    for path in (left / "chunk-0", left, spooled):
        os.utime(path, (time.time() - 60, time.time() - 60))
    with TestClient(create_app(settings)) as client:
        assert not left.exists() and not spooled.exists()  # swept as the app starts
        stale = init(client, archive, {}).json()["upload_id"]
        assert send_chunk(client, stale, 0, archive[:CHUNK]).status_code == 200
        live = init(client, other, {}).json()["upload_id"]
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # this client keeps going (chunk 0 again: the same bytes)
            assert send_chunk(client, live, 0, other[:CHUNK]).status_code == 200
            time.sleep(0.2)
        gone = send_chunk(client, stale, 1, archive[CHUNK : 2 * CHUNK])
        assert gone.status_code == 404 and "does not exist" in gone.json()["error"]["message"]
        assert init(client, archive, {}).json() == {"upload_id": stale, "received_chunks": []}
        assert init(client, other, {}).json() == {"upload_id": live, "received_chunks": [0]}
