"""The model catalog over a real control plane: hand-published checkpoints become servable models.

A step published with `checkpoint.publish_step` reaches the catalog by the trainer's notice
(POST /v1/internal/published) or by the file poll; workers see it in get_work replies, clients in
/v1/megatron/list_models, /v1/models and the names /v1/generate accepts.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

from scalarlm.checkpoint.staging import stage_step, staging_root
from scalarlm.protocol.backend import OpenAIReply, WorkSource
from scalarlm.protocol.generate import EngineLoad
from scalarlm.protocol.training import CheckpointManifest

from loop_helpers import hand_published_job, publish


async def work_models(client: Any) -> dict[str, dict[str, Any]]:
    """The models a worker learns of in its get_work reply, by name."""
    reply = await client.post("/v1/generate/get_work", json={"capacity": 0})
    assert reply.status_code == 200, reply.text
    return {m["name"]: m for m in reply.json()["models"]}


async def test_notice_publishes_a_version_workers_and_clients_see(control_plane, tiny_model_dir: Path) -> None:
    async with control_plane(training={"poll_seconds": 3600}) as (client, settings):
        assert (await work_models(client))["tiny"] == {
            "name": "tiny", "version": 0, "kind": "base", "path": str(tiny_model_dir)
        }
        job = hand_published_job(settings, "job-a", [3], tiny_model_dir)
        reply = await client.post("/v1/internal/published", json={"job_id": "job-a", "step": 3})
        assert reply.status_code == 200 and reply.json() == {"job_id": "job-a", "version": 3}
        models = await work_models(client)
        assert models["job-a"] == {"name": "job-a", "version": 3, "kind": "full", "path": str(job.step_dir(3))}

        listed = {m["name"]: m for m in (await client.get("/v1/megatron/list_models")).json()["models"]}
        assert listed["job-a"]["version"] == 3 and listed["job-a"]["status"] == "RUNNING"
        assert listed["tiny"]["version"] == 0

        queued = await client.post("/v1/generate", json={"prompts": ["hi"], "model": "job-a"})
        assert queued.status_code == 200 and queued.json()["results"][0]["model"] == "job-a"
        latest = await client.post("/v1/generate", json={"prompts": ["hi"], "model": "latest"})
        assert latest.json()["results"][0]["model"] == "job-a"
        unknown = await client.post("/v1/generate", json={"prompts": ["hi"], "model": "job-nope"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"

        missing = await client.post("/v1/internal/published", json={"job_id": "job-nope", "step": 1})
        assert missing.status_code == 404


async def test_poll_picks_up_steps_without_a_notice(control_plane, tiny_model_dir: Path) -> None:
    async with control_plane(training={"poll_seconds": 0.1}) as (client, settings):
        job = hand_published_job(settings, "job-b", [1], tiny_model_dir)
        await wait_for_version(client, "job-b", 1)
        publish(job, 2, tiny_model_dir)
        await wait_for_version(client, "job-b", 2)
        newer = hand_published_job(settings, "job-c", [5], tiny_model_dir, kind="lora")
        await wait_for_version(client, "job-c", 5)
        assert (await work_models(client))["job-c"]["kind"] == "lora"
        latest = await client.post("/v1/generate", json={"prompts": ["hi"], "model": "latest"})
        assert latest.json()["results"][0]["model"] == "job-c"  # the newest job
        del newer


async def test_a_job_without_a_published_step_is_not_a_model(control_plane, tiny_model_dir: Path) -> None:
    async with control_plane(training={"poll_seconds": 0.1}) as (client, settings):
        hand_published_job(settings, "job-d", [], tiny_model_dir)
        reply = await client.post("/v1/generate", json={"prompts": ["hi"], "model": "job-d"})
        assert reply.status_code == 404
        reply = await client.post("/v1/generate", json={"prompts": ["hi"], "model": "latest"})
        assert reply.status_code == 404 and "latest" in reply.json()["error"]["message"]


async def wait_for_version(client: Any, name: str, version: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await work_models(client)).get(name, {}).get("version") == version:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never reached version {version}: {await work_models(client)}")


async def test_a_deleted_jobs_staged_copy_is_removed_and_a_live_jobs_kept(control_plane, tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """A job deleted while a full-weight step is staged in memory: the poll removes that copy (nothing serves or lands
    it any more; it would hold its size in memory until the host restarts); a live job's copy stays, as after the
    shutdown (it has not landed)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    async with control_plane(training={"poll_seconds": 0.1, "staging_dir": str(shm)}) as (client, settings):
        root = staging_root(str(shm), settings.home)
        assert root is not None
        copies = {}
        for name in ("job-live", "job-deleted"):
            job = hand_published_job(settings, name, [1], tiny_model_dir)
            manifest = CheckpointManifest(job_id=name, step=2, base_model=str(tiny_model_dir), kind="full")
            copies[name] = stage_step(job, root, manifest, lambda d: (d / "model.safetensors").write_bytes(b"w"))
            await wait_for_version(client, name, 2)  # served from the staged copy
        shutil.rmtree(settings.jobs_dir / "job-deleted")
        deadline = time.monotonic() + 10
        while (root / "job-deleted").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not (root / "job-deleted").exists()
        assert (copies["job-live"] / "model.safetensors").read_bytes() == b"w"
    assert (copies["job-live"] / "model.safetensors").exists()


class ModelsOnlyWorker:
    """An embedded-worker seam answering /v1/models the way vLLM does for the base model only."""

    def __init__(self) -> None:
        self.backend = self
        self.source: WorkSource | None = None

    def load(self) -> EngineLoad:
        return EngineLoad(max_num_seqs=4)

    async def healthy(self) -> bool:
        return True

    async def openai(self, route: str, body: dict[str, Any], model: Any = None) -> OpenAIReply:
        data = [{"id": "tiny", "object": "model", "created": 1, "owned_by": "vllm", "root": "/m", "parent": None,
                 "max_model_len": 512, "permission": []}]  # fmt: skip
        return OpenAIReply(200, body={"object": "list", "data": data})

    async def start(self, source: WorkSource) -> None:
        self.source = source

    async def stop(self) -> None:
        pass


async def test_openai_models_lists_trained_models_with_their_version(control_plane, tiny_model_dir: Path) -> None:
    async with control_plane(worker=ModelsOnlyWorker(), training={"poll_seconds": 3600}) as (client, settings):
        hand_published_job(settings, "job-e", [2], tiny_model_dir)
        await client.post("/v1/internal/published", json={"job_id": "job-e", "step": 2})
        data = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert data["tiny"]["scalarlm_version"] == 0
        assert data["job-e"]["scalarlm_version"] == 2 and data["job-e"]["object"] == "model"
        assert data["job-e"]["parent"] == "tiny" and data["job-e"]["max_model_len"] == 512
        reply = await client.post("/v1/chat/completions", json={"model": "job-x", "messages": []})
        assert reply.status_code == 404


async def test_published_notice_needs_the_admin_scope_when_keys_are_on(control_plane, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("gen-key generate\nadmin-key admin\n")
    async with control_plane(server={"api_keys_file": str(keys)}) as (client, _):
        notice = {"job_id": "job-nope", "step": 1}
        assert (await client.post("/v1/internal/published", json=notice)).status_code == 401
        headers = {"authorization": "Bearer gen-key"}
        assert (await client.post("/v1/internal/published", json=notice, headers=headers)).status_code == 403
        headers = {"authorization": "Bearer admin-key"}
        assert (await client.post("/v1/internal/published", json=notice, headers=headers)).status_code == 404
