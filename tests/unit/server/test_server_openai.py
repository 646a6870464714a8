"""OpenAI routes in front of the backend: unknown model, bad bodies, admission (429 + Retry-After).

Real OpenAI serving is tested against a real vLLM engine in tests/e2e. Here the worker is a tiny
stand-in whose load() reports a saturated engine and whose answers can be held open: the only cheap
way to produce overload. What is under test is the control plane's checks and admission, not the
stand-in.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from scalarlm.protocol.backend import OpenAIReply, WorkSource
from scalarlm.protocol.generate import EngineLoad, GetWorkRequest
from scalarlm.server.app import create_app

SSE = [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]


class SaturatedBackend:
    """Reports one sequence slot, in use; holds non-streamed answers until `gate` is set."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.bodies: list[dict[str, Any]] = []

    def load(self) -> EngineLoad:
        return EngineLoad(running=1, max_num_seqs=1)

    async def healthy(self) -> bool:
        return True

    async def openai(self, route: str, body: dict[str, Any], model: Any = None) -> OpenAIReply:
        self.bodies.append(body)
        if route == "models":
            return OpenAIReply(200, body={"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        if body.get("stream"):
            return OpenAIReply(200, stream=self._sse())
        self.entered.set()
        await self.gate.wait()
        return OpenAIReply(200, body={"object": "text_completion", "model": body["model"]})

    async def _sse(self) -> AsyncIterator[bytes]:
        for chunk in SSE:
            yield chunk


class InProcessWorker:
    """The embedded-worker seam: records the WorkSource it was started with."""

    def __init__(self) -> None:
        self.backend = SaturatedBackend()
        self.source: WorkSource | None = None
        self.stopped = False

    async def start(self, source: WorkSource) -> None:
        self.source = source

    async def stop(self) -> None:
        self.stopped = True


async def test_unknown_model_is_openai_404_and_bad_bodies_400(running_app) -> None:
    async with running_app(worker=InProcessWorker()) as client:
        reply = await client.post("/v1/chat/completions", json={"model": "gpt-17", "messages": []})
        assert reply.status_code == 404
        assert reply.json()["error"]["param"] == "model" and "gpt-17" in reply.json()["error"]["message"]
        reply = await client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]
        reply = await client.post("/v1/completions", json=[1, 2])
        assert reply.status_code == 400 and "object" in reply.json()["error"]["message"]
        for constant in (b"NaN", b"Infinity", b"-Infinity"):  # Python reads them; JSON (and the worker) cannot
            body = b'{"model": "tiny", "prompt": "a", "temperature": ' + constant + b"}"
            reply = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert reply.status_code == 400 and constant.decode() in reply.json()["error"]["message"], reply.text


async def test_beyond_capacity_is_429_with_retry_after(running_app) -> None:
    worker = InProcessWorker()
    async with running_app(worker=worker, server={"admit_factor": 1.0}) as client:
        held = asyncio.create_task(client.post("/v1/completions", json={"model": "tiny", "prompt": "a"}))
        await asyncio.wait_for(worker.backend.entered.wait(), 30)
        refused = await client.post("/v1/completions", json={"model": "tiny", "prompt": "b"})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        worker.backend.gate.set()
        assert (await held).status_code == 200
        again = await client.post("/v1/completions", json={"model": "tiny", "prompt": "c"})
        assert again.status_code == 200  # the slot came back


async def test_stream_is_passed_through_and_frees_its_slot(running_app) -> None:
    worker = InProcessWorker()
    worker.backend.gate.set()
    async with running_app(worker=worker, server={"admit_factor": 1.0}) as client:
        for _ in range(2):  # a second stream is admitted only if the first gave its slot back
            reply = await client.post("/v1/chat/completions", json={"messages": [], "stream": True})
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            assert reply.content == b"".join(SSE)
        assert worker.backend.bodies[0]["model"] == "tiny"  # no model: the base model


async def test_models_health_and_embedded_worker_lifecycle(running_app) -> None:
    worker = InProcessWorker()
    async with running_app(worker=worker) as client:
        assert isinstance(worker.source, WorkSource)
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "tiny"
        assert (await client.get("/v1/health")).json() == {"api": "up", "vllm": "up", "all": "up"}
        text = (await client.get("/metrics")).text
        assert "scalarlm_engine_running 1.0" in text and "scalarlm_engine_kv_cache_usage 0.0" in text
    assert worker.stopped


async def test_without_any_worker_openai_routes_are_503_and_health_says_so(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert reply.status_code == 503
    assert (await client.get("/v1/health")).json() == {"api": "up", "vllm": "down", "all": "down"}


async def test_embedded_restart_requeues_leases_of_the_dead_worker(running_app) -> None:
    async with running_app() as client:
        await client.post("/v1/generate", json={"prompts": ["a", "b"]})
        leased = (await client.post("/v1/generate/get_work", json={"capacity": 2})).json()["requests"]
        assert len(leased) == 2
    worker = InProcessWorker()
    async with running_app(worker=worker) as client:
        counts = (await client.get("/v1/generate/metrics")).json()["queue"]
        assert (counts["queued"], counts["leased"]) == (2, 0)
        again = await worker.source.get_work(GetWorkRequest(capacity=5))
        assert sorted(i.request_id for i in again.requests) == sorted(i["request_id"] for i in leased)


async def test_prometheus_text(client: httpx.AsyncClient, work) -> None:
    await client.post("/v1/generate", json={"prompts": ["a", "b", "c"]})
    await work(client, capacity=1)
    await client.post("/v1/generate", json={"prompts": []})
    text = (await client.get("/metrics")).text
    assert 'scalarlm_queue_items{state="queued"} 2.0' in text
    assert 'scalarlm_queue_items{state="completed"} 1.0' in text
    assert "scalarlm_tokens_per_second" in text and "scalarlm_requests_per_second" in text
    assert 'scalarlm_http_requests_total{method="POST",route="/v1/generate",status="400"} 1.0' in text
    assert "scalarlm_http_requests_in_flight 1.0" in text  # the scrape itself
    assert 'route="/v1/generate/get_work",status="200"' in text


class LeftBackend:
    """Holds every non-streamed answer for a minute and records when its request is cancelled instead; one free
    sequence slot (a leaked admission ticket would make the next request 429)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.calls = 0

    def load(self) -> EngineLoad:
        return EngineLoad(running=0, max_num_seqs=1)

    async def healthy(self) -> bool:
        return True

    async def openai(self, route: str, body: dict[str, Any], model: Any = None) -> OpenAIReply:
        self.calls += 1
        if self.calls > 1:
            return OpenAIReply(200, body={"object": "text_completion", "model": body["model"]})
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return OpenAIReply(200, body={})


@contextmanager
def served(app: Any) -> Iterator[str]:
    """`app` on a real uvicorn server (a thread), so a client can really disconnect; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_client_that_leaves_ends_its_request_and_frees_its_slot(settings_with: Any) -> None:
    worker = InProcessWorker()
    worker.backend = LeftBackend()
    app = create_app(settings_with(server={"admit_factor": 1.0}), worker=worker)
    with served(app) as url:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "a"}, timeout=0.5)
        assert worker.backend.cancelled.wait(10)  # the engine's handler was cancelled: vLLM aborts the request
        reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "b"}, timeout=30)
        assert reply.status_code == 200, reply.text  # its admission slot was given back
