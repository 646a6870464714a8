"""Operator routes ScalarLM has beside training: a job's dataset and checkpoints, the launcher queue (`squeue`), one
request's status, the workers and what they serve, and export of a trained model (merged weights or the adapter)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import shutil
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Query
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from scalarlm.checkpoint import JobDir, list_steps, read_manifest
from scalarlm.checkpoint.export import directory_size, plan_export, tar_stream, write_export
from scalarlm.launcher import read_record
from scalarlm.protocol.generate import EngineLoad, GenerateResult
from scalarlm.server.deps import QueueDep, StateDep
from scalarlm.server.routers.training import JobsDep

logger = logging.getLogger(__name__)

router = APIRouter(tags=["operator"])
PREVIEW_ROWS = 20


class DatasetResponse(BaseModel):
    """A job's uploaded rows: how many, their size, and the first few."""

    job_id: str
    rows: int
    bytes: int
    preview: list[Any]


class CheckpointEntry(BaseModel):
    step: int
    version: int
    kind: str
    bytes: int
    files: list[str]
    created: float
    loss: float | None = None
    latest: bool = False


class CheckpointsResponse(BaseModel):
    job_id: str
    checkpoints: list[CheckpointEntry]


class QueuedJob(BaseModel):
    """A job the launchers hold (queued or running), with what its launcher says about its processes."""

    job_id: str
    status: str
    launcher: str | None
    launcher_id: str | None
    state: str
    detail: str | None = None
    step: int = 0
    max_steps: int = 0
    start_time: float | None = None


class SqueueResponse(BaseModel):
    jobs: list[QueuedJob]
    # The same jobs as text, one line each (ScalarLM's SDK CLI prints this field).
    squeue_output: str = ""


SQUEUE_COLUMNS = ("JOBID", "STATUS", "LAUNCHER", "LAUNCHER_ID", "STATE", "STEP", "DETAIL")


def squeue_text(jobs: list[QueuedJob]) -> str:
    """A table like SLURM's squeue: a header, then one left-aligned row per job."""
    rows = [SQUEUE_COLUMNS] + [
        (j.job_id, j.status, j.launcher or "-", j.launcher_id or "-", j.state, f"{j.step}/{j.max_steps}",
         j.detail or "")
        for j in jobs
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(SQUEUE_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


class WorkerEntry(BaseModel):
    """A worker as its last get_work described it: the model versions it has loaded and its engine load."""

    worker_id: str
    last_seen: float
    loaded: dict[str, int]
    holding: str | None
    load: EngineLoad | None


class WorkersResponse(BaseModel):
    workers: list[WorkerEntry]


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    merged: bool = False
    step: int | None = Field(None, ge=0)


class ExportResponse(BaseModel):
    """An export written on the server's shared volume."""

    job_id: str
    step: int
    kind: str
    path: str
    files: list[str]
    bytes: int


@router.get("/v1/megatron/train/{job_id}/dataset", response_model=DatasetResponse)
def dataset(job_id: str, jobs: JobsDep, limit: Annotated[int, Query(ge=0, le=1000)] = PREVIEW_ROWS) -> DatasetResponse:
    """The number of rows the job trains on and the first `limit` of them."""
    path = jobs.job(job_id).dataset_path
    rows, preview = 0, []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            if rows < limit:
                try:
                    preview.append(json.loads(line))
                except json.JSONDecodeError:
                    preview.append(line.rstrip("\n"))
            rows += 1
    return DatasetResponse(job_id=job_id, rows=rows, bytes=path.stat().st_size, preview=preview)


@router.get("/v1/megatron/train/{job_id}/dataset/download")
def dataset_download(job_id: str, jobs: JobsDep) -> FileResponse:
    """The job's dataset as the JSONL file it trains on."""
    path = jobs.job(job_id).dataset_path
    return FileResponse(path, media_type="application/jsonl", filename=f"{job_id}.jsonl")


@router.get("/v1/megatron/train/{job_id}/checkpoints", response_model=CheckpointsResponse)
def checkpoints(job_id: str, jobs: JobsDep) -> CheckpointsResponse:
    """Every published checkpoint: its step (= the served version), kind, size and files."""
    job = jobs.job(job_id)
    steps = list_steps(job)
    entries = []
    for step in steps:
        manifest = read_manifest(job, step)
        root = job.step_dir(step)
        entries.append(CheckpointEntry(
            step=step, version=step, kind=manifest.kind, bytes=directory_size(root), created=manifest.created,
            files=sorted(p.name for p in root.iterdir() if p.is_file()), loss=manifest.loss, latest=step == steps[-1],
        ))  # fmt: skip
    return CheckpointsResponse(job_id=job_id, checkpoints=entries)


@router.get("/v1/megatron/squeue", response_model=SqueueResponse)
def squeue(jobs: JobsDep) -> SqueueResponse:
    """Jobs that are queued or running, oldest first, with their launcher's id and whether their processes run."""
    root = jobs.settings.jobs_dir
    held = []
    for path in sorted(p for p in root.iterdir() if (p / "status.json").exists()) if root.exists() else []:
        job = JobDir(path)
        try:
            status = job.read_status()
        except (OSError, ValueError):
            continue
        if status.terminal:
            continue
        record = read_record(job)
        launcher = jobs.launchers.get(record.launcher) if record else None
        state, detail = launcher.state(job) if launcher is not None else ("unknown", "not launched yet")
        held.append(QueuedJob(job_id=job.job_id, status=status.status, launcher=status.launcher,
                              launcher_id=status.launcher_id, state=state, detail=detail, step=status.step,
                              max_steps=status.max_steps, start_time=status.start_time))  # fmt: skip
    return SqueueResponse(jobs=held, squeue_output=squeue_text(held))


@router.get("/v1/generate/request/{request_id}", response_model=GenerateResult)
async def request_status(request_id: str, queue: QueueDep) -> GenerateResult:
    """One request's status (queued, leased, completed, failed) and its result when done; 404 for an unknown id."""
    (result,) = await queue.get([request_id])
    return result


@router.get("/v1/generate/workers", response_model=WorkersResponse)
async def workers(queue: QueueDep) -> WorkersResponse:
    """The workers that asked for work, with the model versions each one has loaded and its engine load."""
    return WorkersResponse(workers=[
        WorkerEntry(worker_id=wid, last_seen=seen.at, loaded=seen.request.loaded, holding=seen.request.holding,
                    load=seen.request.load) for wid, seen in sorted(queue.workers.items())
    ])  # fmt: skip


def _exports_dir(state: StateDep) -> Path:
    return state.settings.home / "exports"


@router.get("/v1/megatron/train/{job_id}/export")
async def export_tar(
    job_id: str, jobs: JobsDep, state: StateDep, background: BackgroundTasks,
    merged: bool = False, step: Annotated[int | None, Query(ge=0)] = None,
) -> StreamingResponse:  # fmt: skip
    """The trained model as an uncompressed tar: merged full weights (LoRA folded into the base) or the adapter."""
    plan = plan_export(jobs.job(job_id), step, merged)
    scratch = _exports_dir(state) / f".stream-{secrets.token_hex(6)}"
    try:
        await asyncio.to_thread(write_export, plan, scratch / plan.name)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    background.add_task(shutil.rmtree, scratch, True)
    stream = tar_stream(scratch / plan.name, plan.name)
    return StreamingResponse(
        stream, media_type="application/x-tar", background=background,
        headers={"content-disposition": f'attachment; filename="{plan.name}.tar"', "x-scalarlm-export": plan.name},
    )  # fmt: skip


@router.post("/v1/megatron/train/{job_id}/export", response_model=ExportResponse)
async def export_dir(job_id: str, body: ExportRequest, jobs: JobsDep, state: StateDep) -> ExportResponse:
    """Write the export into `$SCALARLM_HOME/exports/<job>-step<N>-<kind>/` on the shared volume (replaced if there)."""
    plan = plan_export(jobs.job(job_id), body.step, body.merged)
    final = _exports_dir(state) / plan.name
    tmp = final.with_name(f".{plan.name}.{secrets.token_hex(4)}.tmp")
    try:
        await asyncio.to_thread(write_export, plan, tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("exported %s to %s", plan.name, final)
    files = sorted(p.name for p in final.iterdir() if p.is_file())
    return ExportResponse(job_id=job_id, step=plan.step, kind="full" if plan.merged else plan.kind, path=str(final),
                          files=files, bytes=directory_size(final))  # fmt: skip

