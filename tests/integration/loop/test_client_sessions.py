"""`llm.rl_session()` through the sync and async clients against a control plane listening on a real port.

The trainer is the stand-in of session_standin.py (see test_session_routes.py): what is under test is the
client: create, step -> version, `last` loss/metrics, typed errors, and the context manager ending it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from scalarlm.client import AsyncScalarLM, ScalarLM
from scalarlm.client.rl import describe_flow
from scalarlm.protocol.errors import InvalidRequest, NotFound
from scalarlm.server.app import create_app
from test_session_routes import RL_ROWS, use_standin_in

from conftest import loop_settings


@pytest_asyncio.fixture
async def api_url(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[str]:
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = loop_settings(tmp_path / "home", tiny_model_dir, server={"port": port},
                             training={"poll_seconds": 0.2})  # fmt: skip
    app = create_app(settings)
    use_standin_in(app)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    for _ in range(600):
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.mark.asyncio(loop_scope="session")
async def test_async_and_sync_sessions(api_url: str) -> None:
    llm = AsyncScalarLM(api_url)
    async with await llm.rl_session(train_args={"learning_rate": 1e-3}) as session:
        assert session.model_name == session.id and session.version == 0
        assert await session.step(RL_ROWS) == 1
        assert await session.step([{"prompt": "a", "completion": "b"}]) == 2
        assert session.last is not None and session.last.loss == pytest.approx(0.5)
        with pytest.raises(InvalidRequest, match="reward"):
            await session.step([{"prompt": "a", "completion": "b", "reward": "x"}])
    assert (await session.info()).status == "COMPLETED"

    def sync_loop() -> tuple[list[int], str]:
        with ScalarLM(api_url) as client:
            with client.rl_session() as s:
                versions = [s.step(RL_ROWS) for _ in range(2)]
            return versions, s.info().status

    assert await asyncio.to_thread(sync_loop) == ([1, 2], "COMPLETED")
    with pytest.raises(NotFound):
        await llm._run(describe_flow("session-nope"))
