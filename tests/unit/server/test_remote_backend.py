"""RemoteBackend (split mode) against a worker-shaped HTTP app: the same paths as
scalarlm/inference/worker_app.py, answered by a stand-in so no engine is needed. What is under test
is the forwarding (JSON, SSE bytes, status codes, load aggregation, unreachable workers)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from scalarlm.protocol.errors import EngineUnavailable
from scalarlm.server.remote_backend import RemoteBackend

SSE = b'data: {"id": "1"}\n\ndata: [DONE]\n\n'


def worker_app(running: int, max_model_len: int | None = None) -> FastAPI:
    app = FastAPI()

    @app.get("/load")
    async def load() -> dict:
        return {"running": running, "waiting": 0, "max_num_seqs": 8, "kv_cache_usage": 0.5,
                "max_model_len": max_model_len}  # fmt: skip

    @app.get("/health")
    async def health() -> dict:
        return {"status": "up"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(iter([SSE]), media_type="text/event-stream")
        if body.get("max_tokens", 1) > 100:
            return JSONResponse({"error": {"message": "too long", "type": "BadRequestError", "code": 400}}, 400)
        return {"object": "text_completion", "served_by": running, "model": body["model"]}

    return app


async def test_forwards_json_streams_errors_and_sums_loads() -> None:
    transport = httpx.ASGITransport(app=worker_app(running=3))
    backend = RemoteBackend(["http://w1"], transport=transport)
    await backend.refresh()
    load = backend.load()
    assert (load.running, load.waiting, load.max_num_seqs, load.kv_cache_usage) == (3, 0, 8, 0.5)
    assert await backend.healthy()
    assert (await backend.openai("models", {})).body["data"][0]["id"] == "tiny"
    reply = await backend.openai("completions", {"model": "tiny", "prompt": "a"})
    assert reply.status_code == 200 and reply.body["served_by"] == 3
    bad = await backend.openai("completions", {"model": "tiny", "prompt": "a", "max_tokens": 1000})
    assert bad.status_code == 400 and bad.body["error"]["message"] == "too long"
    stream = await backend.openai("completions", {"model": "tiny", "prompt": "a", "stream": True})
    assert stream.stream is not None
    assert b"".join([chunk async for chunk in stream.stream]) == SSE
    await backend.close()


async def test_unreachable_workers_are_503_and_count_with_configured_capacity() -> None:
    backend = RemoteBackend(["http://127.0.0.1:9"], default_max_num_seqs=4)
    await backend.refresh()
    assert backend.load().max_num_seqs == 4
    assert not await backend.healthy()
    with pytest.raises(EngineUnavailable):
        await backend.openai("completions", {"model": "tiny"})
    await backend.close()
    empty = RemoteBackend([])
    with pytest.raises(EngineUnavailable):
        await empty.openai("models", {})
    await empty.close()


async def test_the_context_length_is_the_shortest_any_worker_reports() -> None:
    """A prompt must fit whichever worker leases it; a worker that reports none (not up yet) does not count."""
    apps = {"http://w1": worker_app(1, 4096), "http://w2": worker_app(1, 2048), "http://w3": worker_app(1)}

    async def route(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        return await httpx.ASGITransport(app=apps[url]).handle_async_request(request)

    backend = RemoteBackend(list(apps), transport=httpx.MockTransport(route))
    assert backend.load().max_model_len is None  # none heard from yet
    await backend.refresh()
    assert backend.load().max_model_len == 2048
    await backend.close()
