"""GET /v1/health: the API, the inference engine, and both together (ScalarLM's keys)."""

from __future__ import annotations

from fastapi import APIRouter

from scalarlm.protocol.health import HealthResponse, State
from scalarlm.server.deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/v1/health", response_model=HealthResponse)
async def health(state: StateDep) -> HealthResponse:
    """`api` is up while this answers; `vllm` is up when a worker's engine answers."""
    engine: State
    if state.backend is None:
        engine = "down" if state.backend_started else "starting"
    else:
        engine = "up" if await state.backend.healthy() else "down"
    return HealthResponse(api="up", vllm=engine, all="up" if engine == "up" else engine)
