"""Split mode over real HTTP: a control plane (`--role api`) and a worker app, both served by uvicorn.

The worker pulls batch work through `HttpWorkSource` and serves the OpenAI routes the control plane
forwards to. The worker reuses the session engine, so no second engine starts.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(app: Any, port: int) -> tuple[Any, asyncio.Task[None]]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    for _ in range(600):
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    assert server.started, "server did not start"
    return server, task


@pytest_asyncio.fixture(loop_scope="session")
async def split(vllm_engine: Any, inference_settings: Any, tmp_path: Any) -> AsyncIterator[dict[str, str]]:
    from scalarlm.inference.worker import InProcessWorker
    from scalarlm.inference.worker_app import create_worker_app
    from scalarlm.server.app import create_app

    api_port, worker_port = _free_port(), _free_port()
    api_url, worker_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{worker_port}"
    server = inference_settings.server.model_copy(
        update={"role": "api", "port": api_port, "worker_port": worker_port, "api_url": api_url,
                "worker_urls": [worker_url]}
    )
    settings = inference_settings.model_copy(update={"server": server, "home": tmp_path})
    # The worker comes up first: its pull loop must ride out the control plane being unreachable.
    worker_app = create_worker_app(settings, InProcessWorker(settings, worker_id="split-worker", engine=vllm_engine))
    worker, worker_task = await _serve(worker_app, worker_port)
    await asyncio.sleep(0.5)
    control, control_task = await _serve(create_app(settings), api_port)
    key = (tmp_path / "internal" / "worker.key").read_text().strip()  # made by the first of the two to start
    try:
        yield {"api": api_url, "worker": worker_url, "key": key}
    finally:
        worker.should_exit = True
        await worker_task
        control.should_exit = True
        await control_task


async def test_batch_and_openai_through_split_mode(split: dict[str, str], vllm_engine: Any) -> None:
    auth = {"Authorization": f"Bearer {split['key']}"}
    async with httpx.AsyncClient(timeout=120) as client:
        health = await client.get(f"{split['worker']}/health")
        assert health.status_code == 200
        load = (await client.get(f"{split['worker']}/load", headers=auth)).json()
        assert load["max_num_seqs"] == 128 and load["max_model_len"] == 512  # max_model_len unset: CPU's default

        # The control plane knows no max_model_len of its own (unset): it checks prompts against the worker's.
        long = {"prompts": ["short", "word " * 600], "max_tokens": 4}
        refused = await client.post(f"{split['api']}/v1/generate", json=long)
        assert refused.status_code == 400, refused.text
        assert "prompts[1] is" in refused.text and "max_model_len is 512" in refused.text
        too_many = await client.post(f"{split['api']}/v1/generate", json={"prompts": ["a"], "max_tokens": 513})
        assert too_many.status_code == 400 and "max_model_len (512)" in too_many.text

        prompts = [f"Tell me about {i}" for i in range(20)]
        submitted = await client.post(f"{split['api']}/v1/generate", json={"prompts": prompts, "max_tokens": 4})
        assert submitted.status_code == 200, submitted.text
        ids = [r["request_id"] for r in submitted.json()["results"]]
        results = (await client.post(f"{split['api']}/v1/generate/get_results",
                                     json={"request_ids": ids, "wait_seconds": 100})).json()["results"]
        assert [r["status"] for r in results] == ["completed"] * 20
        assert all(r["model"] == "tiny" and r["version"] == 0 and r["response"] is not None for r in results)

        # Interactive requests: the control plane forwards to the worker's OpenAI routes.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        direct = await client.post(f"{split['worker']}/v1/chat/completions", json=chat, headers=auth)
        forwarded = await client.post(f"{split['api']}/v1/chat/completions", json=chat)
        assert direct.status_code == forwarded.status_code == 200
        assert forwarded.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
        assert forwarded.json()["system_fingerprint"] == "scalarlm-tiny-v0"

        async with client.stream("POST", f"{split['worker']}/v1/completions", headers=auth,
                                 json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = (await resp.aread()).decode()
        events = [e for e in raw.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert all(json.loads(e[6:])["scalarlm_version"] == 0 for e in events[:-1])

        bad = await client.post(f"{split['worker']}/v1/completions", content=b"{not json", headers=auth)
        assert bad.status_code == 400 and "error" in bad.json()
        models = (await client.get(f"{split['worker']}/v1/models", headers=auth)).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
    assert vllm_engine.load.in_flight == 0


async def test_a_published_model_answers_through_the_api_before_any_batch_names_it(
    split: dict[str, str], inference_settings: Any, tiny_model_dir: Any, tmp_path: Any
) -> None:
    """Issue 16 in split mode: the API sends the model's entry with the request; the worker loads it."""
    import shutil

    from swap_checkpoints import transformers_greedy, write_full_checkpoint

    from scalarlm.checkpoint import JobDir, publish_step
    from scalarlm.protocol.training import CheckpointManifest

    source = write_full_checkpoint(tiny_model_dir, tmp_path / "source", seed=31)
    job = JobDir.under(tmp_path / "jobs", "job-split")  # the split fixture's home is tmp_path
    job.create()

    def write(tmp: Any) -> None:
        for f in source.iterdir():
            if f.is_file() and f.name != "manifest.json":
                shutil.copy(f, tmp / f.name)

    publish_step(job, CheckpointManifest(job_id="job-split", step=3, base_model=str(tiny_model_dir), kind="full"),
                 write)  # fmt: skip
    expected = transformers_greedy(tiny_model_dir, ["Hello there"], 6, full=source)[0]
    body = {"model": "job-split", "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as client:
        try:
            reply = await client.post(f"{split['api']}/v1/completions", json=body)
            async with client.stream("POST", f"{split['api']}/v1/completions", json={**body, "stream": True}) as resp:
                raw = (await resp.aread()).decode()
            # The worker loads only checkpoints inside the jobs directory it shares with the API.
            outside = {"name": "job-x", "version": 1, "kind": "full", "path": str(source)}
            refused = await client.post(f"{split['worker']}/v1/completions", json={**body, "model": "job-x"},
                                        headers={"X-ScalarLM-Model": json.dumps(outside),
                                                 "Authorization": f"Bearer {split['key']}"})  # fmt: skip
        finally:
            await client.post(f"{split['api']}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == expected
    assert (reply.json()["model"], reply.json()["scalarlm_version"]) == ("job-split", 3)
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert {(e["model"], e["scalarlm_version"]) for e in events} == {("job-split", 3)}
    assert refused.status_code == 400 and "outside this worker's jobs directory" in refused.json()["error"]["message"]


async def test_a_worker_answers_only_its_control_plane(split: dict[str, str]) -> None:
    """Without the worker key (or with another) every worker route but /health is 401; the key is in no URL."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    async with httpx.AsyncClient(timeout=60) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": split["key"]}):
            for method, path in (("GET", "/load"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                                 ("POST", "/v1/chat/completions")):  # fmt: skip
                resp = await client.request(method, f"{split['worker']}{path}", json=body, headers=headers)
                assert resp.status_code == 401, (path, headers, resp.text)
                assert resp.json()["error"]["type"] == "authentication_error"
        assert (await client.get(f"{split['worker']}/health")).status_code == 200
        forwarded = await client.post(f"{split['api']}/v1/completions", json=body)  # the API presents the key
        assert forwarded.status_code == 200, forwarded.text


async def test_a_client_that_leaves_ends_its_request_in_the_engine(split: dict[str, str], vllm_engine: Any) -> None:
    """Through the control plane and the split worker: a client that gives up on a non-streamed completion ends the
    engine's work on it (the control plane closes its connection to the worker, whose handler is cancelled, and vLLM
    aborts the request) well before the request would have finished."""
    import time

    body = {"model": "tiny", "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "n": 16, "temperature": 1.0}

    def engine_idle() -> bool:
        return vllm_engine.load.in_flight == 0 and vllm_engine.llm.output_processor.get_num_unfinished_requests() == 0

    async with httpx.AsyncClient(timeout=120) as client:
        started = time.monotonic()
        whole = await client.post(f"{split['api']}/v1/completions", json=body)
        assert whole.status_code == 200, whole.text
        full = time.monotonic() - started
        assert full > 1.0, f"the request took {full:.2f} s: too short to see it cut"
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, read=0.3)) as client:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            await client.post(f"{split['api']}/v1/completions", json=body)
    left = time.monotonic()
    while not engine_idle():
        assert time.monotonic() - left < full / 2, f"the engine still runs the request after {full / 2:.2f} s"
        await asyncio.sleep(0.02)
