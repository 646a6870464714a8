"""Control-plane fixtures: a real app on a real SQLite file, driven over ASGI with httpx.

The "worker" in these tests is the test itself calling /v1/generate/get_work and /finish_work over
HTTP: that is the real worker protocol, so the routes are exercised exactly as a worker uses them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from scalarlm.config import Settings
from scalarlm.server import create_app

MAX_MODEL_LEN = 64


def make_settings(home: Path, model_dir: Path, **sections: Any) -> Settings:
    """Small limits so the bad-input paths are cheap to reach."""
    base: dict[str, Any] = {
        "engine": {"max_model_len": MAX_MODEL_LEN},
        "generate": {"response_timeout": 5.0, "max_lease_batch": 64},
        "upload": {"max_upload_bytes": 64 * 1024, "max_request_bytes": 256 * 1024},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return Settings(home=home, model=str(model_dir), served_model_name="tiny", **base)


@pytest.fixture
async def running_app(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Callable[..., Any]]:
    """A factory: `async with running_app(**settings_sections) as client` (lifespan run for real)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def start(worker: Any = None, **sections: Any) -> AsyncIterator[httpx.AsyncClient]:
        app = create_app(make_settings(tmp_path / "home", tiny_model_dir, **sections), worker=worker)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://control-plane", timeout=60) as client:
                yield client

    yield start


@pytest.fixture
def settings_with(tmp_path: Path, tiny_model_dir: Path) -> Callable[..., Settings]:
    """settings_with(**sections): these tests' settings (make_settings) with those sections changed."""
    return lambda **sections: make_settings(tmp_path / "home", tiny_model_dir, **sections)


@pytest.fixture
async def client(running_app: Callable[..., Any]) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app() as c:
        yield c


async def work_once(client: httpx.AsyncClient, capacity: int, answer: Callable[[dict], str] | None = None,
                    worker_id: str = "test-worker") -> list[dict]:
    """Lease up to `capacity` items over HTTP and post a result for each; returns the leased items."""
    reply = await client.post("/v1/generate/get_work", json={"worker_id": worker_id, "capacity": capacity})
    assert reply.status_code == 200, reply.text
    items = reply.json()["requests"]
    if items:
        results = [
            {
                "request_id": item["request_id"],
                "model": item["model"],
                "version": 0,
                "prompt_tokens": 3,
                "outputs": [{"text": (answer or _echo)(item), "finish_reason": "stop", "token_ids": [5, 6]}],
            }
            for item in items
        ]
        done = await client.post("/v1/generate/finish_work", json={"worker_id": worker_id, "results": results})
        assert done.status_code == 200, done.text
    return items


def _echo(item: dict) -> str:
    return f"echo:{item['prompt']}" if item.get("prompt") is not None else "echo:chat"


@pytest.fixture
def work() -> Callable[..., Any]:
    """The HTTP worker step (`await work(client, capacity, answer=None)`)."""
    return work_once
