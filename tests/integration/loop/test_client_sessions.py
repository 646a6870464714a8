"""`llm.rl_session()` through the sync and async clients against a control plane listening on a real port.

The trainer is the stand-in of session_standin.py (see test_session_routes.py): what is under test is the
client: create, step -> version, `last` loss/metrics, typed errors, the context manager ending it, and `submit()`:
a step queued while the previous one trains (the order read back from the session files), futures, the bound on
steps in flight and the refusal of a batch already too stale.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.session import SessionDir
from scalarlm.client import AsyncScalarLM, ScalarLM
from scalarlm.client.rl import describe_flow, step_state_flow
from scalarlm.protocol.errors import Conflict, InvalidRequest, NotFound, QueueFull
from scalarlm.protocol.training import SessionStepResponse
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
        with pytest.raises(InvalidRequest, match=r"rows\[0\]: field 'reward' is required"):
            await session.step([{"prompt": "a", "completion": "b"}])  # an SFT row: a session trains GRPO by default
        assert await session.step(RL_ROWS) == 2
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


SLOW_ROWS = [{"prompt": "3+4=", "completion": "slow", "reward": 1.0}, *RL_ROWS]


def _session_files(home: Path, session_id: str) -> SessionDir:
    return SessionDir(JobDir(home / "jobs" / session_id))


@pytest.mark.asyncio(loop_scope="session")
async def test_submit_queues_the_next_step_while_one_trains(api_url: str, tmp_path: Path) -> None:
    def sync_loop() -> tuple[str, list[SessionStepResponse]]:
        with ScalarLM(api_url) as client, client.rl_session() as s:
            assert (s.max_staleness, s.stale_policy) == (1, "refuse")
            first = s.submit(SLOW_ROWS, version=0)
            while s.info().status != "RUNNING":
                time.sleep(0.05)
            time.sleep(0.3)  # the stand-in is inside step 1 (a 1 s step) now
            second = s.submit(RL_ROWS, version=0)
            assert not first.done()
            with pytest.raises(QueueFull, match="2 steps in flight"):
                s.submit(RL_ROWS, version=0)
            answers = [first.result(), second.result()]
            assert s.version == 2 and s.last == answers[1]
            with pytest.raises(Conflict, match="generated with version 0 is 2 versions older than the weights at "
                                               "version 2"):  # fmt: skip
                s.submit(RL_ROWS, version=0)
            with pytest.raises(NotFound):
                s._run(step_state_flow(s.id, 9, 0.0))
            return s.id, answers

    session_id, (one, two) = await asyncio.to_thread(sync_loop)
    assert [(a.request, a.version, a.generated_version) for a in (one, two)] == [(1, 1, 0), (2, 2, 0)]
    files = _session_files(tmp_path / "home", session_id)
    first, second = files.read_result(1), files.read_result(2)
    accepted = files.read_meta(2).accepted
    assert first.started < accepted < first.finished <= second.started  # accepted while step 1 trained
    assert files.request_path(2).stat().st_mtime < files.result_path(1).stat().st_mtime


@pytest.mark.asyncio(loop_scope="session")
async def test_async_submit_and_a_synchronous_session(api_url: str) -> None:
    llm = AsyncScalarLM(api_url)
    async with await llm.rl_session(max_staleness=0) as session:
        future = await session.submit(SLOW_ROWS)
        with pytest.raises(QueueFull, match="max_staleness 0"):  # one step in flight: a synchronous loop
            await session.submit(RL_ROWS)
        answer = await future
        assert (answer.version, answer.request, await future.done()) == (1, 1, True)
        assert await session.step(RL_ROWS, version=1) == 2  # the blocking step waits for a free slot
        assert session.last is not None and session.last.generated_version == 1
    assert (await session.info()).max_staleness == 0


async def _answer_generates(url: str, stop: asyncio.Event) -> None:
    """The worker protocol, played by the test: every leased prompt answers its `n` completions "slow", stamped with
    the version the control plane names for its model (so the stand-in's steps take a second and the version stamps
    are real)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not stop.is_set():
            work = (await http.post("/v1/generate/get_work", json={"worker_id": "test", "capacity": 64})).json()
            versions = {m["name"]: m["version"] for m in work["models"]}
            results = [{"request_id": item["request_id"], "model": item["model"],
                        "version": versions.get(item["model"], 0), "prompt_tokens": 2,
                        "outputs": [{"text": "slow", "finish_reason": "stop", "token_ids": [5]}]
                        * item["sampling"]["n"]}
                       for item in work["requests"]]  # fmt: skip
            if results:
                await http.post("/v1/generate/finish_work", json={"worker_id": "test", "results": results})
            else:
                await asyncio.sleep(0.02)


def _prompts(step: int) -> list[str]:
    return [f"{step}+1=", f"{step}+2="]


def _score(prompts: list, results: list) -> list[dict]:
    return [{"prompt": p, "completion": o.text, "reward": float(i), "group": p}
            for p, r in zip(prompts, results) for i, o in enumerate(r.outputs or [])]  # fmt: skip


@pytest.mark.asyncio(loop_scope="session")
async def test_pipeline_generates_the_next_batch_while_a_step_trains(api_url: str) -> None:
    stop = asyncio.Event()
    worker = asyncio.create_task(_answer_generates(api_url, stop))
    try:
        llm = AsyncScalarLM(api_url)
        async with await llm.rl_session() as session:
            steps = [s async for s in session.pipeline(_prompts, _score, 3, max_tokens=2, n=2, temperature=1.0)]
        # Batch 2 is generated on version 0 while step 1 trains, batch 3 on version 1 while step 2 trains.
        assert [(s.index, s.generated_version, s.version, s.response.staleness) for s in steps] == [
            (0, 0, 1, 0), (1, 0, 2, 1), (2, 1, 3, 1)]  # fmt: skip
        assert [s.prompts for s in steps] == [_prompts(i) for i in range(3)]
        assert [len(s.rows) for s in steps] == [4, 4, 4]  # two completions of each of two prompts
        assert {r.model for r in steps[2].results} == {session.model_name}

        def sync_pipeline() -> list[tuple[int, int, int | None]]:
            with ScalarLM(api_url) as client, client.rl_session(max_staleness=0) as s:
                return [(p.generated_version, p.version, p.response.staleness)
                        for p in s.pipeline(_prompts, _score, 3, max_tokens=2, n=2, temperature=1.0)]  # fmt: skip

        # max_staleness 0: a synchronous loop, each batch generated on the newest weights.
        assert await asyncio.to_thread(sync_pipeline) == [(0, 1, 0), (1, 2, 0), (2, 3, 0)]
    finally:
        stop.set()
        await worker
