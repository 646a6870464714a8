"""The `generate` settings change what clients and workers see from the real app: default max_tokens, lease size and
length, long-poll waits, and how long finished results stay readable."""

from __future__ import annotations

import asyncio
import time

import httpx


async def _ids(client: httpx.AsyncClient, prompts: list[str]) -> list[str]:
    reply = await client.post("/v1/generate", json={"prompts": prompts})
    assert reply.status_code == 200, reply.text
    return [r["request_id"] for r in reply.json()["results"]]


async def test_default_max_tokens_is_what_a_prompt_without_one_gets(running_app, work) -> None:
    async with running_app(generate={"default_max_tokens": 7}) as client:
        await _ids(client, ["x"])
        [item] = await work(client, capacity=1)
        assert item["sampling"]["max_tokens"] == 7


async def test_leases_hold_at_most_max_lease_batch_for_lease_seconds(running_app) -> None:
    async with running_app(generate={"max_lease_batch": 2, "lease_seconds": 7.0}) as client:
        await _ids(client, [f"p{i}" for i in range(5)])
        reply = (await client.post("/v1/generate/get_work", json={"worker_id": "w", "capacity": 10})).json()
        assert len(reply["requests"]) == 2 and reply["lease_seconds"] == 7.0


async def test_long_polls_wait_response_timeout_by_default_and_never_past_max_wait_seconds(running_app) -> None:
    async with running_app(generate={"response_timeout": 0.3, "max_wait_seconds": 0.6}) as client:
        ids = await _ids(client, ["never answered"])
        start = time.monotonic()
        got = await client.post("/v1/generate/get_results", json={"request_ids": ids})  # no wait_seconds
        assert 0.3 <= time.monotonic() - start < 0.6 and got.json()["results"][0]["status"] == "queued"
        start = time.monotonic()
        got = await client.post("/v1/generate/get_results", json={"request_ids": ids, "wait_seconds": 600})
        assert 0.6 <= time.monotonic() - start < 30 and got.json()["results"][0]["status"] == "queued"
        start = time.monotonic()
        reply = await client.post("/v1/generate", json={"prompts": ["b"], "wait_seconds": 600})
        assert reply.status_code == 200 and 0.6 <= time.monotonic() - start < 30


async def test_finished_results_are_deleted_after_result_retention_seconds(running_app, work) -> None:
    async with running_app(generate={"result_retention_seconds": 0.05, "housekeeping_interval": 0.05}) as client:
        ids = await _ids(client, ["a"])
        await work(client, capacity=1)
        deadline = time.monotonic() + 20
        while (reply := await client.post("/v1/generate/get_results", json={"request_ids": ids})).status_code == 200:
            assert time.monotonic() < deadline, "the finished result was never deleted"
            await asyncio.sleep(0.05)
        assert reply.status_code == 404 and ids[0] in reply.json()["error"]["message"]
