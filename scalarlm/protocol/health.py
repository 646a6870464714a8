"""Health and model listing."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

State = Literal["up", "down", "starting"]


class HealthResponse(BaseModel):
    """GET /v1/health: each part and the whole (ScalarLM's keys)."""

    api: State
    vllm: State
    all: State
