"""Training routes, wire-compatible with ScalarLM 1.151's SDK: submit (single POST or chunked), status, control."""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Header, Query, Request, UploadFile
from fastapi.responses import PlainTextResponse, StreamingResponse

from scalarlm.launcher import copy_upload
from scalarlm.protocol.errors import EngineUnavailable, InvalidRequest, PayloadTooLarge, ScalarLMError
from scalarlm.protocol.training import (
    DeleteJobResponse,
    GpuCountResponse,
    ListModelsResponse,
    NodeCountResponse,
    TrainingJobResponse,
    TrainResponse,
    UploadChunkResponse,
    UploadFinalizeRequest,
    UploadInitRequest,
    UploadInitResponse,
)
from scalarlm.server.deps import SettingsDep, StateDep
from scalarlm.server.jobs import TrainingJobs, args_before_rows, train_params
from scalarlm.server.limits import check_job_limit, count_job
from scalarlm.server.training_uploads import UploadSessions

router = APIRouter(prefix="/v1/megatron", tags=["training"])
alias_router = APIRouter(tags=["training"])


def get_jobs(request: Request) -> TrainingJobs:
    jobs = getattr(request.app.state, "training", None)
    if jobs is None:
        raise EngineUnavailable("training is not enabled on this server")
    return jobs


def get_uploads(jobs: Annotated[TrainingJobs, Depends(get_jobs)]) -> UploadSessions:
    return UploadSessions(jobs.uploads_dir, jobs.settings.upload)


JobsDep = Annotated[TrainingJobs, Depends(get_jobs)]
UploadsDep = Annotated[UploadSessions, Depends(get_uploads)]


def _submit_upload(jobs: TrainingJobs, file: UploadFile, params: str | None, request: Request) -> TrainResponse:
    """Spool the uploaded archive to the home volume, submit it, remove the spool file."""
    check_job_limit(request, jobs.is_running)
    jobs.uploads_dir.mkdir(parents=True, exist_ok=True)
    spool = jobs.uploads_dir / f"single-{secrets.token_hex(8)}"
    try:
        copy_upload(file.file, spool, jobs.settings.upload.max_upload_bytes)
        response = jobs.submit(spool, params)
    finally:
        spool.unlink(missing_ok=True)
    count_job(request, response.job_status["job_id"])
    return response


@router.post("/train", response_model=TrainResponse)
def train(
    request: Request,
    jobs: JobsDep,
    file: Annotated[UploadFile, File(description="tar/tar.gz holding dataset.jsonlines, or a JSONL file")],
    params: Annotated[str | None, Form(description="train args as a JSON object")] = None,
) -> TrainResponse:
    """Start a training job from a ScalarLM-style multipart upload (any bundled code is ignored)."""
    return _submit_upload(jobs, file, params, request)


@alias_router.post("/v1/train", response_model=TrainResponse)
def train_alias(
    request: Request,
    jobs: JobsDep,
    file: Annotated[UploadFile, File()],
    params: Annotated[str | None, Form()] = None,
) -> TrainResponse:
    """Same as POST /v1/megatron/train."""
    return _submit_upload(jobs, file, params, request)


@router.post("/upload/init", response_model=UploadInitResponse)
def upload_init(body: UploadInitRequest, jobs: JobsDep, uploads: UploadsDep) -> UploadInitResponse:
    """Open (or resume) a chunked upload; train args are checked now, before any data is sent."""
    args_before_rows(train_params(body.params), jobs.settings.training)
    return uploads.init(body)


@router.post("/upload/chunk", response_model=UploadChunkResponse)
async def upload_chunk(
    request: Request,
    uploads: UploadsDep,
    upload_id: Annotated[str, Header(alias="X-Upload-Id")],
    chunk_index: Annotated[int, Header(alias="X-Chunk-Index")],
    chunk_hash: Annotated[str | None, Header(alias="X-Chunk-Hash")] = None,
) -> UploadChunkResponse:
    """Store one chunk (raw body); 422 when it does not match X-Chunk-Hash."""
    data = await request.body()
    if len(data) > uploads.limits.max_chunk_bytes:
        raise PayloadTooLarge(f"chunk is larger than {uploads.limits.max_chunk_bytes} bytes", param="body")
    return uploads.chunk(upload_id, chunk_index, chunk_hash, data)


@router.post("/upload/finalize", response_model=TrainResponse)
def upload_finalize(
    body: UploadFinalizeRequest, jobs: JobsDep, uploads: UploadsDep, request: Request
) -> TrainResponse:
    """Join the chunks, check the archive's hash, and submit it like POST /v1/megatron/train."""
    check_job_limit(request, jobs.is_running)
    archive, session = uploads.assemble(body.upload_id)
    try:
        response = jobs.submit(archive, session.params)
    except InvalidRequest:
        uploads.discard(body.upload_id)  # the data itself is bad: a retry cannot succeed
        raise
    except ScalarLMError:
        archive.unlink(missing_ok=True)  # keep the chunks: finalize may be retried
        raise
    uploads.discard(body.upload_id)
    count_job(request, response.job_status["job_id"])
    return response


@router.get("/train/logs/{job_id}")
def stream_logs(
    job_id: str, jobs: JobsDep, starting_line_number: Annotated[int, Query(ge=0)] = 0
) -> StreamingResponse:
    """ScalarLM's log stream (its SDK CLI's `logs`): the job's log lines from `starting_line_number` (0-based) as
    JSON lines `{"line_number", "line"}`; `latest` names the newest job. Declared before `/train/{job_id}/...`."""
    lines = jobs.logs(job_id).splitlines(keepends=True)[starting_line_number:]
    chunks = (json.dumps({"line_number": starting_line_number + i, "line": line}) + "\n"
              for i, line in enumerate(lines))
    return StreamingResponse(chunks, media_type="text/event-stream")


@router.get("/train/{job_id}", response_model=TrainingJobResponse)
def get_training_job(job_id: str, jobs: JobsDep) -> TrainingJobResponse:
    """Status (with loss history), config, published checkpoints and the latest metrics row."""
    return jobs.describe(job_id)


@router.get("/train/{job_id}/metrics")
def get_metrics(job_id: str, jobs: JobsDep) -> list[dict[str, Any]]:
    """Every per-step metrics row the trainer wrote so far."""
    return jobs.metrics(job_id)


@router.get("/train/{job_id}/logs", response_class=PlainTextResponse)
def get_logs(job_id: str, jobs: JobsDep) -> str:
    """The launcher's output and each rank's log."""
    return jobs.logs(job_id)


@router.get("/list_models", response_model=ListModelsResponse)
def list_models(jobs: JobsDep) -> ListModelsResponse:
    """The base model and every training job with its progress."""
    return jobs.list_models()


@router.post("/cancel/{job_id}")
def cancel(job_id: str, jobs: JobsDep) -> dict[str, Any]:
    """Stop a job (its trainer saves state first); answers with the job's status."""
    return jobs.cancel(job_id)


@router.post("/resume/{job_id}")
def resume(job_id: str, jobs: JobsDep, request: Request) -> dict[str, Any]:
    """Relaunch a FAILED or CANCELLED job from its saved state (409 if it runs or completed); answers its status."""
    check_job_limit(request, jobs.is_running)
    body = jobs.resume(job_id)
    count_job(request, job_id)
    return body


@router.post("/delete/{job_id}", response_model=DeleteJobResponse)
def delete(job_id: str, jobs: JobsDep, state: StateDep) -> DeleteJobResponse:
    """Cancel the job if it runs and remove its directory; its model is gone from every route at once."""
    deleted = jobs.delete(job_id)
    state.catalog.forget(job_id)
    return deleted


@router.get("/gpu_count", response_model=GpuCountResponse)
def gpu_count(settings: SettingsDep) -> GpuCountResponse:
    """GPUs available to training jobs (configured per node x nodes; 0 on a CPU box)."""
    return GpuCountResponse(gpu_count=settings.training.gpus_per_node * settings.training.nodes)


@router.get("/node_count", response_model=NodeCountResponse)
def node_count(settings: SettingsDep) -> NodeCountResponse:
    """Nodes available to training jobs."""
    return NodeCountResponse(node_count=settings.training.nodes)
