"""RL session routes: create a long-lived trainer, submit one batch per step (blocking, or queued while an earlier
step trains), read it, end it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from scalarlm.protocol.errors import EngineUnavailable
from scalarlm.protocol.training import (
    SessionCreateRequest,
    SessionResponse,
    SessionStepRequest,
    SessionStepResponse,
    SessionStepState,
)
from scalarlm.server.limits import check_job_limit, count_job
from scalarlm.server.sessions import RLSessions

router = APIRouter(prefix="/v1/train/sessions", tags=["sessions"])


def get_sessions(request: Request) -> RLSessions:
    sessions = getattr(request.app.state, "sessions", None)
    if sessions is None:
        raise EngineUnavailable("training is not enabled on this server")
    return sessions


SessionsDep = Annotated[RLSessions, Depends(get_sessions)]


@router.post("", response_model=SessionResponse)
def create_session(request: Request, body: SessionCreateRequest, sessions: SessionsDep) -> SessionResponse:
    """Start an RL session: a trainer that keeps model and optimizer in memory (full weights by default); it counts
    against the key's `max_jobs` like a training job."""
    check_job_limit(request, sessions.jobs.is_running)
    created = sessions.create(body)
    count_job(request, created.session_id)
    return created


@router.post("/{session_id}/step", response_model=SessionStepResponse)
async def step_session(session_id: str, body: SessionStepRequest, sessions: SessionsDep) -> SessionStepResponse:
    """One optimizer step on these rows; answers once the new weights are published, with their version."""
    return await sessions.step(session_id, body)


@router.post("/{session_id}/steps", response_model=SessionStepState)
async def submit_step(session_id: str, body: SessionStepRequest, sessions: SessionsDep) -> SessionStepState:
    """Queue one step and answer at once with its request index (it trains after the steps before it)."""
    return await sessions.submit(session_id, body)


@router.get("/{session_id}/steps/{request}", response_model=SessionStepState)
async def get_step(session_id: str, request: int, sessions: SessionsDep,
                   wait_seconds: float = Query(0.0, ge=0, le=600)) -> SessionStepState:  # fmt: skip
    """A queued step: "trained" with its answer, or "queued" after waiting up to `wait_seconds`; its error if refused."""
    return await sessions.state(session_id, request, wait_seconds)


@router.get("/{session_id}", response_model=SessionResponse)
def get_session(session_id: str, sessions: SessionsDep) -> SessionResponse:
    """The session's status and current weights version."""
    return sessions.describe(session_id)


@router.delete("/{session_id}", response_model=SessionResponse)
async def end_session(session_id: str, sessions: SessionsDep) -> SessionResponse:
    """End the session (its trainer exits after the current step); its published weights stay servable."""
    return await sessions.end(session_id)
