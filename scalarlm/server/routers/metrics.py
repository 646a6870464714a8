"""GET /metrics: Prometheus text from the app's own registry."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from scalarlm.server.deps import StateDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=PlainTextResponse)  # documented as text, as served
async def prometheus_metrics(state: StateDep) -> Response:
    """Queue depth by state, requests/s and tokens/s, engine load, HTTP requests by route and status."""
    text = await asyncio.to_thread(state.metrics.render)
    return Response(text, media_type=CONTENT_TYPE_LATEST)
