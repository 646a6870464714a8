"""Batch routes end to end, with ScalarLM-SDK-shaped JSON and the real worker protocol over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx

from scalarlm.protocol.generate import SamplingParams


def set_fields(sampling: dict) -> dict:
    """The sampling fields that differ from their defaults (the wire carries them all)."""
    defaults = SamplingParams().model_dump()
    return {k: v for k, v in sampling.items() if v != defaults[k]}


async def test_generate_get_results_in_scalarlm_sdk_shape(client: httpx.AsyncClient, work) -> None:
    # Exactly what masint's submit_generate sends.
    reply = await client.post("/v1/generate", json={"prompts": ["hello", "world"], "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["response"] for r in results] == [None, None]
    assert all(r["error"] is None for r in results)
    ids = [r["request_id"] for r in results]
    assert re.fullmatch(r"[0-9a-f]+_000000000", ids[0]) and ids[1].endswith("_000000001")

    items = await work(client, capacity=10)
    assert [i["prompt"] for i in items] == ["hello", "world"]
    assert items[0]["model"] == "tiny" and items[0]["sampling"]["max_tokens"] == 8

    # masint's get_results sends only request_ids.
    got = await client.post("/v1/generate/get_results", json={"request_ids": ids})
    body = got.json()
    assert [r["response"] for r in body["results"]] == ["echo:hello", "echo:world"]
    first = body["results"][0]
    assert first["status"] == "completed" and first["model"] == "tiny" and first["version"] == 0
    assert first["completion_tokens"] == 2 and first["finish_reason"] == "stop"


async def test_default_max_tokens_and_base_model_by_path(client: httpx.AsyncClient, work, tiny_model_dir) -> None:
    reply = await client.post("/v1/generate", json={"prompts": ["x"], "model": str(tiny_model_dir)})
    assert reply.status_code == 200, reply.text
    [item] = await work(client, capacity=1)
    assert item["model"] == "tiny" and set_fields(item["sampling"]) == {"max_tokens": 16}


async def test_chat_prompts_and_every_sampling_field_reach_the_worker(client: httpx.AsyncClient, work) -> None:
    messages = [{"role": "user", "content": "hi"}]
    reply = await client.post(
        "/v1/generate",
        json={"prompts": [{"messages": messages}, {"prompt": "plain"}], "max_tokens": 4, "temperature": 0.7,
              "top_p": 0.9, "seed": 3, "stop": ["\n"], "n": 2, "logprobs": 1},
    )
    assert reply.status_code == 200, reply.text
    chat, plain = await work(client, capacity=10)
    assert chat["messages"] == messages and chat["prompt"] is None and plain["prompt"] == "plain"
    sampling = chat["sampling"]
    assert (sampling["temperature"], sampling["top_p"], sampling["seed"], sampling["n"]) == (0.7, 0.9, 3, 2)
    assert sampling["stop"] == ["\n"] and sampling["logprobs"] == 1 and sampling["max_tokens"] == 4


async def test_generate_can_wait_for_results(client: httpx.AsyncClient, work) -> None:
    async def worker() -> None:
        while not await work(client, capacity=10):
            await asyncio.sleep(0.01)

    task = asyncio.create_task(worker())
    reply = await client.post("/v1/generate", json={"prompts": ["a", "b", "c"], "wait_seconds": 30})
    await task
    assert [r["response"] for r in reply.json()["results"]] == ["echo:a", "echo:b", "echo:c"]


async def test_get_results_long_polls_and_returns_early_when_done(client: httpx.AsyncClient, work) -> None:
    ids = [r["request_id"] for r in (await client.post("/v1/generate", json={"prompts": ["a", "b"]})).json()["results"]]

    async def slow_worker() -> None:
        await asyncio.sleep(0.2)
        await work(client, capacity=10)

    task = asyncio.create_task(slow_worker())
    start = time.monotonic()
    got = await client.post("/v1/generate/get_results", json={"request_ids": ids, "wait_seconds": 60})
    assert time.monotonic() - start < 30  # woken by finish_work, not by the 60 s timeout
    assert [r["response"] for r in got.json()["results"]] == ["echo:a", "echo:b"]
    await task


async def test_partial_results_at_the_long_poll_timeout(client: httpx.AsyncClient, work) -> None:
    ids = [r["request_id"] for r in (await client.post("/v1/generate", json={"prompts": ["a", "b"]})).json()["results"]]
    await work(client, capacity=1)
    got = await client.post("/v1/generate/get_results", json={"request_ids": ids, "wait_seconds": 0.1})
    assert [r["response"] for r in got.json()["results"]] == ["echo:a", None]
    assert [r["status"] for r in got.json()["results"]] == ["completed", "queued"]


def sdk_upload_file(prompts: list[str], model: str | None = None, max_tokens: int | None = None) -> bytes:
    """The JSON file masint's upload_generate writes."""
    rows = [{"prompt": p, "model": model, "max_tokens": max_tokens, "request_type": "generate"} for p in prompts]
    return json.dumps(rows).encode()


async def test_upload_then_download_partial_then_complete(client: httpx.AsyncClient, work) -> None:
    prompts = [f"p{i}" for i in range(150)]
    reply = await client.post("/v1/generate/upload", files={"file": ("requests.json", sdk_upload_file(prompts))})
    assert reply.status_code == 200, reply.text
    upload = reply.json()
    assert upload["total_requests"] == 150 and "_" not in upload["request_id"]

    empty = (await client.post("/v1/generate/download", json={"request_id": upload["request_id"], "wait_seconds": 0})).json()
    assert (empty["current_index"], empty["total_requests"], empty["results"]) == (0, 150, {})

    await work(client, capacity=60)
    partial = (await client.post("/v1/generate/download", json={"request_id": upload["request_id"], "wait_seconds": 0})).json()
    assert partial["current_index"] == 60 and len(partial["results"]) == 60

    while await work(client, capacity=64):
        pass
    # masint's poll_for_downloads sends only request_id, then sorts keys by their numeric suffix.
    final = (await client.post("/v1/generate/download", json={"request_id": upload["request_id"]})).json()
    assert final["current_index"] == final["total_requests"] == 150
    ordered = [r for _, r in sorted(final["results"].items(), key=lambda kv: int(kv[0].split("_")[-1]))]
    assert [r["response"] for r in ordered] == [f"echo:{p}" for p in prompts]
    assert all(r["error"] is None for r in ordered)


async def test_upload_items_carry_their_own_sampling_and_chat(client: httpx.AsyncClient, work) -> None:
    rows = [{"prompt": "a", "max_tokens": 3, "temperature": 0.5}, {"messages": [{"role": "user", "content": "hi"}]},
            {"prompt": {"prompt": "nested"}, "model": "tiny"}, "bare string"]
    reply = await client.post("/v1/generate/upload", files={"file": ("r.json", json.dumps(rows).encode())})
    assert reply.status_code == 200, reply.text
    items = await work(client, capacity=10)
    assert set_fields(items[0]["sampling"]) == {"max_tokens": 3, "temperature": 0.5}
    assert items[1]["messages"][0]["content"] == "hi" and set_fields(items[1]["sampling"]) == {"max_tokens": 16}
    assert [items[2]["prompt"], items[3]["prompt"]] == ["nested", "bare string"]


async def test_text_content_parts_are_joined_and_tools_travel_with_chat_prompts(client: httpx.AsyncClient, work
                                                                                ) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    reply = await client.post("/v1/generate", json={
        "prompts": [{"messages": [{"role": "user", "content": parts}]}], "tools": tools, "tool_choice": "auto"})
    assert reply.status_code == 200, reply.text
    rows = [{"messages": [{"role": "user", "content": parts}], "tools": tools}, {"prompt": "plain"}]
    reply = await client.post("/v1/generate/upload", files={"file": ("r.json", json.dumps(rows).encode())})
    assert reply.status_code == 200, reply.text
    chat, uploaded, plain = await work(client, capacity=10)
    # As vLLM's chat renderer joins text parts for a template that takes string content.
    assert chat["messages"] == [{"role": "user", "content": "first\nsecond"}] and chat["tools"] == tools
    assert uploaded["messages"] == chat["messages"] and uploaded["tools"] == tools
    assert plain["prompt"] == "plain" and plain["tools"] is None


async def test_download_long_polls_until_complete(client: httpx.AsyncClient, work) -> None:
    reply = await client.post("/v1/generate/upload", files={"file": ("r.json", sdk_upload_file(["a", "b"]))})
    batch = reply.json()["request_id"]

    async def slow_worker() -> None:
        await asyncio.sleep(0.2)
        await work(client, capacity=10)

    task = asyncio.create_task(slow_worker())
    final = (await client.post("/v1/generate/download", json={"request_id": batch, "wait_seconds": 60})).json()
    assert final["current_index"] == 2
    await task


async def test_finish_work_counts_duplicates(client: httpx.AsyncClient, work) -> None:
    await client.post("/v1/generate", json={"prompts": ["a"]})
    [item] = await work(client, capacity=1)
    again = await client.post(
        "/v1/generate/finish_work",
        json={"results": [{"request_id": item["request_id"], "model": "tiny", "outputs": [{"text": "late"}]}]},
    )
    assert again.json() == {"accepted": 0, "duplicates": 1}
    got = await client.post("/v1/generate/get_results", json={"request_ids": [item["request_id"]], "wait_seconds": 0})
    assert got.json()["results"][0]["response"] == "echo:a"


async def test_worker_failure_is_reported_per_item(client: httpx.AsyncClient) -> None:
    ids = [r["request_id"] for r in (await client.post("/v1/generate", json={"prompts": ["a"]})).json()["results"]]
    [item] = (await client.post("/v1/generate/get_work", json={"capacity": 1})).json()["requests"]
    await client.post("/v1/generate/finish_work",
                      json={"results": [{"request_id": item["request_id"], "model": "tiny", "error": "engine said no"}]})
    [result] = (await client.post("/v1/generate/get_results", json={"request_ids": ids})).json()["results"]
    assert result["error"] == "engine said no" and result["response"] is None and result["status"] == "failed"


async def test_generate_metrics_and_clear_queue(client: httpx.AsyncClient, work) -> None:
    submitted = await client.post("/v1/generate", json={"prompts": ["a", "b", "c", "d"]})
    ids = [r["request_id"] for r in submitted.json()["results"]]
    await work(client, capacity=1)
    await client.post("/v1/generate/get_work", json={"capacity": 1})
    metrics = (await client.get("/v1/generate/metrics")).json()
    assert metrics["queue"] == {"queued": 2, "leased": 1, "completed": 1, "failed": 0}
    assert metrics["queue_depth"] == 3 and metrics["total_completed"] == 1 and metrics["total_tokens"] == 2
    assert metrics["requests_per_second"] > 0 and metrics["tokens_per_second"] > 0
    assert (await client.post("/v1/generate/clear_queue")).json() == {"cleared": 3}
    metrics = (await client.get("/v1/generate/metrics")).json()
    assert metrics["queue_depth"] == 0 and metrics["queue"]["failed"] == 3 and metrics["total_completed"] == 1
    # The batch reads back at once (no 404 for the cleared ids): the finished answer, then why the rest have none.
    got = await client.post("/v1/generate/get_results", json={"request_ids": ids, "wait_seconds": 30})
    assert got.status_code == 200, got.text
    results = got.json()["results"]
    assert [r["status"] for r in results] == ["completed", "failed", "failed", "failed"]
    assert results[0]["response"] == "echo:a" and all("clear_queue" in r["error"] for r in results[1:])


async def test_prompts_are_checked_against_the_context_the_pulling_workers_serve(client: httpx.AsyncClient) -> None:
    """No backend here (workers only pull): the shortest max_model_len a worker reported with its get_work bounds
    max_tokens and prompts at submission, ahead of the setting (64 in these tests)."""
    assert (await client.post("/v1/generate", json={"prompts": ["a"], "max_tokens": 40})).status_code == 200
    for worker, length in (("w-long", 4096), ("w-short", 32)):
        reply = await client.post("/v1/generate/get_work", json={"worker_id": worker, "capacity": 0,
                                                                 "load": {"max_model_len": length}})  # fmt: skip
        assert reply.status_code == 200, reply.text
    refused = await client.post("/v1/generate", json={"prompts": ["a"], "max_tokens": 40})
    assert refused.status_code == 400 and "max_model_len (32)" in refused.text, refused.text
    long = await client.post("/v1/generate", json={"prompts": ["hello world " * 20], "max_tokens": 4})
    assert long.status_code == 400 and "max_model_len is 32" in long.text, long.text
