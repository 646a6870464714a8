"""Batch generate routes, wire-compatible with ScalarLM 1.151's SDK, and the worker's pull routes."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import UploadFile

from scalarlm.config import Settings
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.generate import (
    ClearQueueResponse,
    DownloadRequest,
    DownloadResponse,
    FinishWorkRequest,
    FinishWorkResponse,
    GenerateMetrics,
    GenerateRequest,
    GenerateResponse,
    GenerateResult,
    GetResultsRequest,
    GetWorkRequest,
    GetWorkResponse,
    UploadResponse,
)
from scalarlm.server.batch_items import BatchBuilder
from scalarlm.server.deps import PromptsDep, QueueDep, SettingsDep, StateDep
from scalarlm.server.download_body import file_chunks, spool_download
from scalarlm.server.limits import request_key, request_usage
from scalarlm.server.telemetry import THROUGHPUT_WINDOW_SECONDS

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/generate", tags=["generate"])


def get_builder(state: StateDep, prompts: PromptsDep) -> BatchBuilder:
    generate = state.settings.generate
    return BatchBuilder(state.catalog, prompts, generate.default_max_tokens, generate.max_batch_prompts)


BuilderDep = Annotated[BatchBuilder, Depends(get_builder)]


@router.post("", response_model=GenerateResponse)
async def generate(
    body: GenerateRequest, queue: QueueDep, builder: BuilderDep, settings: SettingsDep, request: Request
) -> GenerateResponse | Response:
    """Store every prompt in one transaction; answer at once or after up to `wait_seconds` for results."""
    if len(body.prompts) > settings.generate.max_batch_prompts:
        raise InvalidRequest(
            f"prompts holds {len(body.prompts)} items; the limit is {settings.generate.max_batch_prompts}",
            param="prompts",
        )
    key, usage = request_key(request), request_usage(request)
    await usage.check_queued(key, len(body.prompts), queue)  # per-key limit: 429 when over
    model, items = await asyncio.to_thread(builder.from_request, body)
    batch = await queue.enqueue(items, model)
    usage.add_batch(key, batch.batch_id)
    wait = min(body.wait_seconds or 0.0, settings.generate.max_wait_seconds)
    if wait <= 0:
        return Response(_queued_results_json(batch.request_ids, model), media_type="application/json")
    return GenerateResponse(results=await queue.wait_results(batch.request_ids, wait))


def _queued_results_json(request_ids: list[str], model: str) -> bytes:
    """`GenerateResponse` JSON for just-stored items, written directly: for 200k prompts, building
    200k pydantic objects would cost seconds and hundreds of MB for identical entries."""
    marker = "\x00request-id\x00"
    before, after = GenerateResult(request_id=marker, model=model).model_dump_json().split(json.dumps(marker))
    entries = ",".join(f"{before}{json.dumps(rid)}{after}" for rid in request_ids)
    return f'{{"results":[{entries}]}}'.encode()


def _wait_seconds(asked: float | None, settings: Settings) -> float:
    """How long a long-poll waits: as asked (default `response_timeout`), at most `max_wait_seconds`."""
    wait = settings.generate.response_timeout if asked is None else asked
    return min(wait, settings.generate.max_wait_seconds)


@router.post("/get_results", response_model=GenerateResponse)
async def get_results(body: GetResultsRequest, queue: QueueDep, settings: SettingsDep) -> GenerateResponse:
    """Results for these ids; long-polls until all are finished or `wait_seconds` pass."""
    wait = _wait_seconds(body.wait_seconds, settings)
    return GenerateResponse(results=await queue.wait_results(body.request_ids, wait))


@router.post("/upload", response_model=UploadResponse)
async def upload(request: Request, queue: QueueDep, builder: BuilderDep, state: StateDep) -> UploadResponse:
    """Multipart `file` = JSON list of prompt objects (the SDK's upload_generate); stored in one transaction."""
    form = await request.form(max_files=1, max_fields=16)
    try:
        file = form.get("file")
        if not isinstance(file, UploadFile):
            raise InvalidRequest("multipart field 'file' (a JSON list of prompts) is required", param="file")
        key, usage = request_key(request), request_usage(request)
        await usage.check_queued(key, 0, queue)  # the count is known only once stored
        batch = await queue.enqueue(builder.from_upload(file.file), state.catalog.base)
        usage.add_batch(key, batch.batch_id)
    finally:
        await form.close()
    return UploadResponse(request_id=batch.batch_id, total_requests=batch.count)


@router.post("/download", response_model=DownloadResponse)
async def download(body: DownloadRequest, queue: QueueDep, settings: SettingsDep) -> StreamingResponse:
    """The finished results of an uploaded batch so far; long-polls up to `wait_seconds` for the rest."""
    wait = _wait_seconds(body.wait_seconds, settings)
    total, finished = await queue.wait_batch(body.request_id, wait)
    file, size = await asyncio.to_thread(spool_download, queue.queue, body.request_id, total, finished)
    return StreamingResponse(
        file_chunks(file), media_type="application/json", headers={"content-length": str(size)}
    )


@router.get("/metrics", response_model=GenerateMetrics)
async def metrics(queue: QueueDep) -> GenerateMetrics:
    """Queue depth per state and recent throughput."""
    counts = await queue.counts()
    recent = await queue.throughput(THROUGHPUT_WINDOW_SECONDS)
    total_completed, total_tokens = await queue.totals()
    return GenerateMetrics(
        queue=counts,
        queue_depth=counts.queued + counts.leased,
        requests_per_second=recent.requests / recent.seconds,
        tokens_per_second=recent.tokens / recent.seconds,
        total_completed=total_completed,
        total_tokens=total_tokens,
    )


@router.post("/clear_queue", response_model=ClearQueueResponse)
async def clear_queue(queue: QueueDep) -> ClearQueueResponse:
    """Take every queued and leased item out of the queue: each becomes a failed result saying it was cleared
    (finished results stay readable)."""
    return ClearQueueResponse(cleared=await queue.clear())


@router.post("/get_work", response_model=GetWorkResponse)
async def get_work(body: GetWorkRequest, queue: QueueDep) -> GetWorkResponse:
    """Worker side: lease up to `capacity` items of one model."""
    return await queue.get_work(body)


@router.post("/finish_work", response_model=FinishWorkResponse)
async def finish_work(body: FinishWorkRequest, queue: QueueDep) -> FinishWorkResponse:
    """Worker side: post results; the first result per request id wins."""
    return await queue.finish_work(body)
