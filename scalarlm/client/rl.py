"""RL sessions from the client: `session = llm.rl_session(...)`, then `version = session.step(rows)` per batch.

A session is a trainer that keeps the model and optimizer in memory and takes one optimizer step per
submitted batch; each step publishes new weights, served under `session.model_name` at the returned
version (generate with `model_name=session.model_name` and `return_details=True` to see it). Rewards are
computed here, on the client (see `scalarlm.rewards`); rows are scored completions
(`{"prompt", "completion", "reward"}`, optional `group`, `logprobs` and `completion_token_ids`: pass a
result's `token_ids` so the trainer trains exactly the sampled tokens) or plain SFT rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from scalarlm.client.flows import Call, Flow
from scalarlm.protocol.training import RLRow, SessionResponse, SessionStepResponse

if TYPE_CHECKING:
    from scalarlm.client.async_client import AsyncScalarLM
    from scalarlm.client.sync_client import ScalarLM

DEFAULT_STEP_WAIT_SECONDS = 600.0
SESSIONS = "/v1/train/sessions"

Rows = Iterable[Mapping[str, Any] | RLRow]


def _row(row: Mapping[str, Any] | RLRow) -> dict[str, Any]:
    return row.model_dump(exclude_none=True) if isinstance(row, BaseModel) else dict(row)


def create_flow(model_name: str | None, train_args: Mapping[str, Any] | None) -> Flow:
    body = yield Call("POST", SESSIONS, json={"model_name": model_name, "train_args": dict(train_args or {})})
    return SessionResponse.model_validate(body)


def step_flow(session_id: str, rows: Rows, wait_seconds: float) -> Flow:
    payload = [_row(r) for r in rows]
    if not payload:
        raise ValueError("a session step needs at least one row")
    body = yield Call("POST", f"{SESSIONS}/{session_id}/step", json={"rows": payload, "wait_seconds": wait_seconds},
                      extra_timeout=wait_seconds)  # fmt: skip
    return SessionStepResponse.model_validate(body)


def describe_flow(session_id: str) -> Flow:
    return SessionResponse.model_validate((yield Call("GET", f"{SESSIONS}/{session_id}")))


def end_flow(session_id: str) -> Flow:
    return SessionResponse.model_validate((yield Call("DELETE", f"{SESSIONS}/{session_id}", extra_timeout=30.0)))


class RLSession:
    """A handle on one RL session; use as a context manager so the trainer ends with the block."""

    def __init__(self, client: "ScalarLM", info: SessionResponse,
                 wait_seconds: float = DEFAULT_STEP_WAIT_SECONDS) -> None:  # fmt: skip
        self.client = client
        self.id = info.session_id
        self.model_name = info.model_name
        self.version = info.version
        self.wait_seconds = wait_seconds
        self.last: SessionStepResponse | None = None

    def __repr__(self) -> str:
        return f"RLSession({self.id!r}, version={self.version})"

    def step(self, rows: Rows) -> int:
        """One optimizer step on `rows`; returns the version now serving (`self.last` has loss and metrics)."""
        self.last = self.client._run(step_flow(self.id, rows, self.wait_seconds))
        self.version = self.last.version
        return self.version

    def info(self) -> SessionResponse:
        """Status and current version."""
        return self.client._run(describe_flow(self.id))

    def close(self) -> SessionResponse:
        """End the session; its published weights stay servable under `model_name`."""
        return self.client._run(end_flow(self.id))

    def __enter__(self) -> "RLSession":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()


class AsyncRLSession:
    """The awaitable twin of `RLSession` (`async with`)."""

    def __init__(self, client: "AsyncScalarLM", info: SessionResponse,
                 wait_seconds: float = DEFAULT_STEP_WAIT_SECONDS) -> None:  # fmt: skip
        self.client = client
        self.id = info.session_id
        self.model_name = info.model_name
        self.version = info.version
        self.wait_seconds = wait_seconds
        self.last: SessionStepResponse | None = None

    def __repr__(self) -> str:
        return f"AsyncRLSession({self.id!r}, version={self.version})"

    async def step(self, rows: Rows) -> int:
        """One optimizer step on `rows`; returns the version now serving."""
        self.last = await self.client._run(step_flow(self.id, rows, self.wait_seconds))
        self.version = self.last.version
        return self.version

    async def info(self) -> SessionResponse:
        return await self.client._run(describe_flow(self.id))

    async def close(self) -> SessionResponse:
        return await self.client._run(end_flow(self.id))

    async def __aenter__(self) -> "AsyncRLSession":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self.close()
