"""The worker's OpenAI backend answers exactly as vLLM's own server does (plus our version stamps).

The reference is vLLM's real FastAPI app (`build_app` + `init_app_state`, what `vllm serve` runs)
over the same session engine, called through httpx's ASGI transport.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="session")

STAMPS = {"system_fingerprint", "scalarlm_version"}
CHAT = [{"role": "user", "content": "What is two plus two?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_server(vllm_engine: Any) -> AsyncIterator[httpx.AsyncClient]:
    """vLLM's own OpenAI app on the same engine: the wire format we must reproduce."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    tasks = await vllm_engine.llm.get_supported_tasks()
    app = build_app(vllm_engine.args, tasks, vllm_engine.llm.model_config)
    await init_app_state(vllm_engine.llm, app.state, vllm_engine.args, tasks)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vllm") as client:
        yield client


async def _sse_events(stream: AsyncIterator[bytes]) -> list[str]:
    raw = b"".join([chunk async for chunk in stream]).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert all(e.startswith("data: ") for e in events[:-1])
    return [e[len("data: "):] for e in events[:-1]]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]  # fmt: skip


def _text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _strip(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in STAMPS}


@pytest.mark.parametrize(
    ("route", "request_body"),
    [
        ("completions", {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}),
        ("chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 6, "temperature": 0}),
        # OpenAI tool calling through the engine's tool-call parser (engine.tool_call_parser, "hermes" here)
        ("chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 6, "temperature": 0, "tools": TOOLS,
                              "tool_choice": "auto"}),
    ],
)
async def test_json_reply_matches_vllm(openai_backend: Any, vllm_server: httpx.AsyncClient, route: str,
                                       request_body: dict[str, Any]) -> None:
    reply = await openai_backend.openai(route, dict(request_body))
    reference = await vllm_server.post(f"/v1/{route}", json=request_body)
    assert reference.status_code == 200
    assert reply.status_code == 200 and reply.stream is None
    ours, theirs = reply.body, reference.json()
    assert set(ours) == set(theirs) | STAMPS
    assert ours["system_fingerprint"] == "scalarlm-tiny-v0" and ours["scalarlm_version"] == 0
    assert ours["object"] == theirs["object"] and ours["model"] == theirs["model"] == "tiny"
    assert set(ours["choices"][0]) == set(theirs["choices"][0])
    assert _text(ours) == _text(theirs)
    assert ours["usage"] == theirs["usage"]


@pytest.mark.parametrize(
    ("route", "request_body"),
    [
        ("completions", {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}),
        ("chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 5, "temperature": 0}),
    ],
)
async def test_stream_matches_vllm(openai_backend: Any, vllm_server: httpx.AsyncClient, route: str,
                                   request_body: dict[str, Any]) -> None:
    body = {**request_body, "stream": True, "stream_options": {"include_usage": True}}
    reply = await openai_backend.openai(route, dict(body))
    assert reply.status_code == 200 and reply.stream is not None
    ours = [json.loads(e) for e in (await _sse_events(reply.stream))[:-1]]

    async with vllm_server.stream("POST", f"/v1/{route}", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        theirs = [json.loads(e) for e in (await _sse_events(resp.aiter_bytes()))[:-1]]

    # How many tokens one chunk carries depends on timing (vLLM merges the outputs a slow reader has not taken yet),
    # so the chunk counts may differ; the first chunk, the usage chunk and the joined text may not.
    assert len(ours) >= 2 and len(theirs) >= 2
    for mine, ref in [(ours[0], theirs[0]), (ours[-1], theirs[-1])]:
        assert set(_strip(mine)) == set(ref) - {"system_fingerprint"}
    for mine in ours:
        assert mine["system_fingerprint"] == "scalarlm-tiny-v0" and mine["scalarlm_version"] == 0
        assert mine["object"] == theirs[0]["object"]
        assert set(_strip(mine)) in [set(ref) - {"system_fingerprint"} for ref in theirs]
    assert ours[-1]["usage"] == theirs[-1]["usage"]

    def joined(chunks: list[dict[str, Any]]) -> str:
        parts = []
        for c in chunks:
            for ch in c["choices"]:
                parts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
        return "".join(parts)

    assert joined(ours) == joined(theirs)


async def test_models_listing_matches_vllm(openai_backend: Any, vllm_server: httpx.AsyncClient) -> None:
    reply = await openai_backend.openai("models", {})
    theirs = (await vllm_server.get("/v1/models")).json()
    assert reply.status_code == 200
    assert [m["id"] for m in reply.body["data"]] == [m["id"] for m in theirs["data"]] == ["tiny"]
    assert set(reply.body["data"][0]) == set(theirs["data"][0])


@pytest.mark.parametrize(
    "request_body",
    [
        {"model": "tiny", "prompt": "hi", "max_tokens": 100000},  # more than max_model_len
        {"model": "no-such-model", "prompt": "hi"},  # unknown model -> 404
        {"model": "tiny", "prompt": "hi", "max_tokens": "many"},  # wrong type -> validation error
        {"model": "tiny", "prompt": "hi", "n": 0, "temperature": "hot"},  # two validation errors
    ],
)
async def test_errors_match_vllm(openai_backend: Any, vllm_server: httpx.AsyncClient,
                                 request_body: dict[str, Any]) -> None:
    reply = await openai_backend.openai("completions", dict(request_body))
    reference = await vllm_server.post("/v1/completions", json=request_body)
    assert reply.status_code == reference.status_code
    assert reply.status_code in (400, 404)
    assert reply.body == reference.json()


async def test_load_and_health(openai_backend: Any) -> None:
    assert await openai_backend.healthy()
    load = openai_backend.load()
    assert load.max_num_seqs == 128
    assert load.running + load.waiting == 0
