"""Internal model-catalog routes: trainers announce published steps here (admin scope when keys are on)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import BaseModel

from scalarlm.protocol.training import PublishedNotice
from scalarlm.server.deps import StateDep

router = APIRouter(prefix="/v1/internal", tags=["internal"])


class PublishedAck(BaseModel):
    """The model's version after the notice."""

    job_id: str
    version: int


@router.post("/published", response_model=PublishedAck)
async def published(body: PublishedNotice, state: StateDep) -> PublishedAck:
    """A trainer published `step` of `job_id`: bump the model's version so workers pick it up on get_work."""
    version = await asyncio.to_thread(state.catalog.published, body.job_id, body.step)
    return PublishedAck(job_id=body.job_id, version=version)
