"""RL sessions from the client: `session = llm.rl_session(...)`, then `version = session.step(rows)` per batch.

A session is a trainer that keeps the model and optimizer in memory and takes one optimizer step per
submitted batch; each step publishes new weights, served under `session.model_name` at the returned
version (generate with `model_name=session.model_name` and `return_details=True` to see it). Rewards are
computed here, on the client (see `scalarlm.rewards`); rows are scored completions
(`{"prompt", "completion", "reward"}`, optional `group`, `logprobs`, `completion_token_ids` and `version`: pass a
result's `token_ids` so the trainer trains exactly the sampled tokens) or plain SFT rows.

Overlap without threads: `future = session.submit(rows, version=...)` queues a step and returns at once (the
server trains it after the steps before it), so the next batch can be generated while it trains;
`future.result()` (sync) or `await future` (async) gives its answer. `session.pipeline(prompts, score, steps)`
does exactly that loop: it keeps one generate in flight while the previous step trains and yields each trained
step. A batch may be generated at most `max_staleness` versions before the weights it trains (a session setting,
default 1); beyond it the step is refused (Conflict naming the versions) or, with `stale_policy="reweight"`,
trained with its importance ratio against the rows' sampling logprobs.

The handles hold a runner (`transport.SyncRunner` / `AsyncRunner`), never a client; each sync method and its
async twin is one line over the same flow.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from pydantic import BaseModel

from scalarlm.client import flows
from scalarlm.client.flows import AsyncRun, Call, Flow, Run
from scalarlm.client.payloads import PromptInput
from scalarlm.protocol.generate import GenerateResult
from scalarlm.protocol.training import RLRow, SessionResponse, SessionStepResponse, SessionStepState, StalePolicy

DEFAULT_STEP_WAIT_SECONDS = 600.0
SESSIONS = "/v1/train/sessions"
# Long-poll window per GET of a queued step's state.
STEP_POLL_SECONDS = 30.0

Rows = Iterable[Mapping[str, Any] | RLRow]
# pipeline(): the prompts of step i, and the scored rows of those prompts' generate results.
PromptsFn = Callable[[int], list[PromptInput]]
ScoreFn = Callable[[list[PromptInput], list[GenerateResult]], Rows]


def _row(row: Mapping[str, Any] | RLRow) -> dict[str, Any]:
    return row.model_dump(exclude_none=True) if isinstance(row, BaseModel) else dict(row)


def _step_body(rows: Rows, version: int | None, wait_seconds: float, overlap: bool | None = None) -> dict[str, Any]:
    payload = [_row(r) for r in rows]
    if not payload:
        raise ValueError("a session step needs at least one row")
    body: dict[str, Any] = {"rows": payload, "wait_seconds": wait_seconds}
    # sent only when known, as older servers take no such fields
    body.update({k: v for k, v in (("version", version), ("overlap", overlap)) if v is not None})
    return body


def create_flow(model_name: str | None, train_args: Mapping[str, Any] | None, max_staleness: int = 1,
                stale_policy: StalePolicy = "refuse") -> Flow:  # fmt: skip
    payload: dict[str, Any] = {"model_name": model_name, "train_args": dict(train_args or {})}
    if (max_staleness, stale_policy) != (1, "refuse"):  # the server's defaults: older servers take no such fields
        payload.update(max_staleness=max_staleness, stale_policy=stale_policy)
    body = yield Call("POST", SESSIONS, json=payload)
    return SessionResponse.model_validate(body)


def step_flow(session_id: str, rows: Rows, wait_seconds: float, version: int | None = None) -> Flow:
    """POST .../step: queue the step and wait for its answer."""
    body = yield Call("POST", f"{SESSIONS}/{session_id}/step", json=_step_body(rows, version, wait_seconds),
                      extra_timeout=wait_seconds)  # fmt: skip
    return SessionStepResponse.model_validate(body)


def submit_flow(session_id: str, rows: Rows, version: int | None = None, overlap: bool | None = None) -> Flow:
    """POST .../steps: queue the step, answered at once with its request index."""
    body = yield Call("POST", f"{SESSIONS}/{session_id}/steps", json=_step_body(rows, version, 0.0, overlap))
    return SessionStepState.model_validate(body)


def step_state_flow(session_id: str, request: int, wait_seconds: float) -> Flow:
    """GET .../steps/{request}: long-poll up to `wait_seconds` for the step's answer."""
    body = yield Call("GET", f"{SESSIONS}/{session_id}/steps/{request}?wait_seconds={wait_seconds:g}",
                      extra_timeout=wait_seconds, retry=True)  # fmt: skip
    return SessionStepState.model_validate(body)


def describe_flow(session_id: str) -> Flow:
    return SessionResponse.model_validate((yield Call("GET", f"{SESSIONS}/{session_id}")))


def end_flow(session_id: str) -> Flow:
    return SessionResponse.model_validate((yield Call("DELETE", f"{SESSIONS}/{session_id}", extra_timeout=30.0)))


@dataclass
class PipelineStep:
    """One trained step of `session.pipeline(...)`: the answer, and the batch it trained (prompts, results, rows)."""

    index: int
    response: SessionStepResponse
    prompts: list[PromptInput]
    results: list[GenerateResult]
    rows: list[dict[str, Any]]
    # The session version that generated the batch (0: the session's base model) and how long generate took.
    generated_version: int
    generate_seconds: float

    @property
    def version(self) -> int:
        """The version now serving (the one this step published)."""
        return self.response.version


class _Session:
    """What a session handle knows, and the flows its sync and async twins run."""

    def __init__(self, run: Any, info: SessionResponse, wait_seconds: float = DEFAULT_STEP_WAIT_SECONDS,
                 base_model: str | None = None) -> None:  # fmt: skip
        self._run = run
        self.id = info.session_id
        self.model_name = info.model_name
        # The model the session started from: it serves the session's version 0 (None: the server's base model).
        self.base_model = base_model
        self.version = info.version
        self.max_staleness = info.max_staleness
        self.stale_policy = info.stale_policy
        self.wait_seconds = wait_seconds
        self.last: SessionStepResponse | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, version={self.version})"

    def _answered(self, response: SessionStepResponse) -> SessionStepResponse:
        """Note a step's answer: `last` and `version` follow the newest step answered (futures resolve in any order)."""
        if self.last is None or response.version >= self.last.version:
            self.last = response
        self.version = max(self.version, response.version)
        return response

    def _step(self, rows: Rows, version: int | None) -> Flow:
        response = yield from step_flow(self.id, rows, self.wait_seconds, version)
        return self._answered(response).version

    def _submit(self, rows: Rows, version: int | None, overlap: bool | None = None) -> Flow:
        return (yield from submit_flow(self.id, rows, version, overlap))

    def _result(self, request: int, timeout: float | None) -> Flow:
        """Long-poll step `request` until trained (TimeoutError after `timeout` seconds; None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = STEP_POLL_SECONDS if deadline is None else min(STEP_POLL_SECONDS, deadline - time.monotonic())
            state = yield from step_state_flow(self.id, request, max(0.0, left))
            if state.result is not None:
                return self._answered(state.result)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"session {self.id}: step {request} is still queued after {timeout:g} s")

    def _generate_and_submit(self, index: int, prompts: PromptsFn, score: ScoreFn, max_tokens: int | None,
                             sampling: dict[str, Any], overlap: bool) -> Flow:  # fmt: skip
        """Generate step `index`'s batch on the newest served version, score it, queue it stamped with that version
        (`overlap`: the next batch is generated while it trains)."""
        own = self.version > 0  # version 0 of the session is the model it started from
        batch = list(prompts(index))
        start = time.monotonic()
        results = yield from flows.generate(batch, self.model_name if own else self.base_model, max_tokens, True,
                                            False, sampling)  # fmt: skip
        seconds = time.monotonic() - start
        served = [r.version for r in results if r.version is not None]
        version = min(served, default=self.version) if own else 0
        rows = [_row(r) for r in score(batch, results)]
        state = yield from self._submit(rows, version, overlap)
        return _Queued(state.request, batch, results, rows, version, seconds)

    def _pipeline(self, prompts: PromptsFn, score: ScoreFn, steps: int, max_tokens: int | None,
                  sampling: dict[str, Any]) -> Iterator[Flow]:  # fmt: skip
        """One flow per step: keep the next batch generating (and queued) while the previous step trains."""
        queued: list[_Queued] = []
        overlap = self.max_staleness > 0
        for index in range(steps):
            yield self._pipeline_step(index, steps, queued, overlap, prompts, score, max_tokens, sampling)

    def _pipeline_step(self, index: int, steps: int, queued: list["_Queued"], overlap: bool, prompts: PromptsFn,
                       score: ScoreFn, max_tokens: int | None, sampling: dict[str, Any]) -> Flow:  # fmt: skip
        def overlapped(i: int) -> bool:  # step i trains while step i + 1's batch is generated
            return overlap and i + 1 < steps

        if not queued:
            queued.append((yield from self._generate_and_submit(index, prompts, score, max_tokens, sampling,
                                                                overlapped(index))))  # fmt: skip
        if overlapped(index):  # generated while step `index` trains
            queued.append((yield from self._generate_and_submit(index + 1, prompts, score, max_tokens, sampling,
                                                                overlapped(index + 1))))  # fmt: skip
        batch = queued.pop(0)
        response = yield from self._result(batch.request, self.wait_seconds)
        return PipelineStep(index, response, batch.prompts, batch.results, batch.rows, batch.version, batch.seconds)


@dataclass
class _Queued:
    request: int
    prompts: list[PromptInput]
    results: list[GenerateResult]
    rows: list[dict[str, Any]]
    version: int
    seconds: float


@dataclass
class _Future:
    session: _Session
    state: SessionStepState
    response: SessionStepResponse | None = field(default=None, init=False)

    @property
    def request(self) -> int:
        """The step's request index in the session."""
        return self.state.request

    def _wait(self, timeout: float | None) -> Flow:
        if self.response is None:
            self.response = yield from self.session._result(self.state.request, timeout)
        return self.response

    def _poll(self) -> Flow:
        if self.response is None:
            state = yield from step_state_flow(self.session.id, self.state.request, 0.0)
            if state.result is not None:
                self.response = self.session._answered(state.result)
        return self.response is not None


class StepFuture(_Future):
    """A queued step of an `RLSession`: `result()` blocks until it is trained (no threads involved)."""

    def done(self) -> bool:
        """Whether the step is trained (asks the server once, without waiting)."""
        return self.session._run(self._poll())

    def result(self, timeout: float | None = None) -> SessionStepResponse:
        """The step's answer once trained; its error (e.g. Conflict for a too stale batch) if refused."""
        return self.session._run(self._wait(timeout))


class AsyncStepFuture(_Future):
    """The awaitable twin of `StepFuture` (`await future` is `await future.result()`)."""

    async def done(self) -> bool:
        return await self.session._run(self._poll())

    async def result(self, timeout: float | None = None) -> SessionStepResponse:
        return await self.session._run(self._wait(timeout))

    def __await__(self) -> Generator[Any, None, SessionStepResponse]:
        return self.result().__await__()


class RLSession(_Session):
    """A handle on one RL session; use as a context manager so the trainer ends with the block."""

    _run: Run

    def step(self, rows: Rows, version: int | None = None) -> int:
        """One optimizer step on `rows` (generated with weights `version`); returns the version now serving."""
        return self._run(self._step(rows, version))

    def submit(self, rows: Rows, version: int | None = None, overlap: bool | None = None) -> StepFuture:
        """Queue a step on `rows` and return at once; generate the next batch while it trains (`overlap=False`
        says you will not, so a CPU trainer beside its CPU engine takes every core for it)."""
        return StepFuture(self, self._run(self._submit(rows, version, overlap)))

    def pipeline(self, prompts: PromptsFn, score: ScoreFn, steps: int, max_tokens: int | None = None,
                 **sampling: Any) -> Iterator[PipelineStep]:  # fmt: skip
        """Yield `steps` trained steps: generate `prompts(i)` (with `sampling`), `score` them, queue the rows,
        with the next batch generated while each step trains (sequential when `max_staleness` is 0)."""
        return (self._run(flow) for flow in self._pipeline(prompts, score, steps, max_tokens, sampling))

    def info(self) -> SessionResponse:
        """Status and current version."""
        return self._run(describe_flow(self.id))

    def close(self) -> SessionResponse:
        """End the session (after its queued steps); its published weights stay servable under `model_name`."""
        return self._run(end_flow(self.id))

    def __enter__(self) -> "RLSession":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()


class AsyncRLSession(_Session):
    """The awaitable twin of `RLSession` (`async with`; `async for step in session.pipeline(...)`)."""

    _run: AsyncRun

    async def step(self, rows: Rows, version: int | None = None) -> int:
        return await self._run(self._step(rows, version))

    async def submit(self, rows: Rows, version: int | None = None, overlap: bool | None = None) -> AsyncStepFuture:
        return AsyncStepFuture(self, await self._run(self._submit(rows, version, overlap)))

    def pipeline(self, prompts: PromptsFn, score: ScoreFn, steps: int, max_tokens: int | None = None,
                 **sampling: Any) -> AsyncIterator[PipelineStep]:  # fmt: skip
        return (await self._run(flow) for flow in self._pipeline(prompts, score, steps, max_tokens, sampling))

    async def info(self) -> SessionResponse:
        return await self._run(describe_flow(self.id))

    async def close(self) -> SessionResponse:
        return await self._run(end_flow(self.id))

    async def __aenter__(self) -> "AsyncRLSession":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self.close()
