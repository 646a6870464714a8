"""The internal notify key: accepted on POST /v1/internal/published only (403 everywhere else), next to an operator's
admin key; it never turns authentication on by itself, and it appears in no answer."""

from __future__ import annotations

import pytest

from scalarlm.launcher.base import notify_key
from scalarlm.server.auth import KeyFileError, parse_key_line

NOTICE = {"job_id": "job-nope", "step": 1}


async def test_internal_key_only_announces_published_steps(running_app, tmp_path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("gen-key generate\nadmin-key admin\n")
    async with running_app(server={"api_keys_file": str(keys)}) as client:
        internal = notify_key(tmp_path / "home")  # created by the control plane when it started
        bearer = {"authorization": f"Bearer {internal}"}
        answers = []
        # Past authentication: 404 because no such job has published (a real trainer's job would get 200).
        reply = await client.post("/v1/internal/published", json=NOTICE, headers=bearer)
        assert reply.status_code == 404, reply.text
        answers.append(reply)
        admin = await client.post("/v1/internal/published", json=NOTICE, headers={"authorization": "Bearer admin-key"})
        assert admin.status_code == 404  # an operator's admin key still works there
        gen = await client.post("/v1/internal/published", json=NOTICE, headers={"authorization": "Bearer gen-key"})
        assert gen.status_code == 403

        for method, path, body in (
            ("POST", "/v1/generate", {"prompts": ["a"]}),
            ("POST", "/v1/generate/get_work", {"capacity": 1}),
            ("POST", "/v1/generate/clear_queue", None),
            ("GET", "/v1/megatron/list_models", None),
            ("POST", "/v1/train/sessions", {}),
            ("POST", "/v1/chat/completions", {"model": "tiny", "messages": []}),
            ("GET", "/v1/models", None),
        ):
            reply = await client.request(method, path, json=body, headers=bearer)
            assert reply.status_code == 403, (path, reply.status_code, reply.text)
            assert "scope" in reply.json()["error"]["message"]
            answers.append(reply)
        answers += [await client.get("/openapi.json"), await client.get("/metrics"), await client.get("/v1/health")]
        assert not [r.url for r in answers if internal in r.text or internal in str(r.headers)]


async def test_internal_key_alone_does_not_turn_authentication_on(running_app, tmp_path) -> None:
    async with running_app() as client:
        assert (tmp_path / "home" / "internal" / "notify.key").exists()
        assert (await client.post("/v1/generate", json={"prompts": ["a"]})).status_code == 200


def test_keys_file_cannot_grant_the_internal_scope() -> None:
    with pytest.raises(KeyFileError, match="unknown scope"):
        parse_key_line("some-key internal")


async def test_worker_key_only_leases_and_posts_work(running_app, tmp_path) -> None:
    """A split-mode control plane (no in-process worker) accepts its worker key on get_work/finish_work only."""
    from scalarlm.checkpoint.keys import worker_key

    keys = tmp_path / "keys.txt"
    keys.write_text("gen-key generate\nadmin-key admin\n")
    async with running_app(server={"api_keys_file": str(keys), "role": "api"}) as client:
        key = worker_key(tmp_path / "home", None)  # the one the control plane created on start
        bearer = {"authorization": f"Bearer {key}"}
        work = {"worker_id": "w1", "capacity": 1}
        assert (await client.post("/v1/generate/get_work", json=work, headers=bearer)).status_code == 200
        finish = await client.post("/v1/generate/finish_work", json={"worker_id": "w1", "results": []}, headers=bearer)
        assert finish.status_code == 200, finish.text
        admin = {"authorization": "Bearer admin-key"}
        assert (await client.post("/v1/generate/get_work", json=work, headers=admin)).status_code == 200
        gen = {"authorization": "Bearer gen-key"}
        assert (await client.post("/v1/generate/get_work", json=work, headers=gen)).status_code == 403
        for method, path, body in (("POST", "/v1/generate", {"prompts": ["a"]}),
                                   ("POST", "/v1/generate/clear_queue", None),
                                   ("GET", "/v1/megatron/list_models", None),
                                   ("POST", "/v1/internal/published", NOTICE)):  # fmt: skip
            reply = await client.request(method, path, json=body, headers=bearer)
            assert reply.status_code == 403, (path, reply.status_code, reply.text)
    assert oct((tmp_path / "home" / "internal" / "worker.key").stat().st_mode & 0o777) == "0o600"


def test_worker_key_from_a_mounted_file_wins(tmp_path) -> None:
    from scalarlm.checkpoint.keys import worker_key

    mounted = tmp_path / "secret"
    mounted.write_text("from-the-secret\n")
    assert worker_key(tmp_path / "home", mounted) == "from-the-secret"
    assert not (tmp_path / "home" / "internal" / "worker.key").exists()
    mounted.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        worker_key(tmp_path / "home", mounted)
