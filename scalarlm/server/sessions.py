"""RL sessions: a long-lived trainer that takes one optimizer step per submitted batch, publishing after each.

A session is a training job with `session=True`, launched like any other. The control plane talks to it
through files (`scalarlm.checkpoint.session`): it writes `request-<k>.jsonl`, the trainer takes one step,
publishes `checkpoints/step-<k>` and writes `result-<k>.json`; an `end` file ends it. Waiting for a result
never blocks the event loop: the file is polled with `asyncio.sleep` in between.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.session import SessionDir
from scalarlm.protocol.errors import Conflict, EngineUnavailable, InvalidRequest, ScalarLMError
from scalarlm.protocol.training import (
    JobStatus,
    SessionCreateRequest,
    SessionResponse,
    SessionStepRequest,
    SessionStepResponse,
    SessionStepResult,
    TrainJobConfig,
)
from scalarlm.protocol.rows import check_step_row
from scalarlm.server.jobs import TrainingJobs, new_job_id, parse_train_args
from scalarlm.server.models import ModelCatalog

logger = logging.getLogger(__name__)

RESULT_POLL_SECONDS = 0.02
STATUS_POLL_SECONDS = 0.5
END_WAIT_SECONDS = 10.0


def check_row(index: int, row: dict[str, Any]) -> None:
    """A scored RL row (`reward` present) or an SFT row (input/output, prompt/completion, messages)."""
    check_step_row(index, row)


class RLSessions:
    """Sessions of this control plane: create (launch), step (request -> result), describe, end."""

    def __init__(self, jobs: TrainingJobs, catalog: ModelCatalog) -> None:
        self.jobs = jobs
        self.catalog = catalog
        # One step at a time per session: request index k must match the trainer's step k.
        self._step_locks: dict[str, asyncio.Lock] = {}

    def create(self, request: SessionCreateRequest) -> SessionResponse:
        """Validate args, write the session's job dir (session=True), launch its trainer."""
        params = dict(request.train_args)
        params.setdefault("adapter_type", "full")  # sessions train every weight unless told otherwise
        params.setdefault("lr_schedule", "constant")  # open-ended: no horizon for a schedule to decay over
        if request.model_name is not None:
            params.setdefault("llm_name", request.model_name)
        args = parse_train_args(params, self.jobs.settings.training)
        base_model = self.jobs.base_model_for(args.llm_name)
        job = JobDir.under(self.jobs.settings.jobs_dir, new_job_id().replace("job-", "session-", 1))
        job.create()
        SessionDir(job).create()
        job.dataset_path.write_text("")
        idle = self.jobs.settings.training.session_idle_seconds
        config = TrainJobConfig(
            job_id=job.job_id, base_model=base_model, train_args=args, created=time.time(), session=True,
            session_idle_seconds=idle or None,  # the trainer ends itself after this long without a step request
        )
        status = self.jobs.launch(job, config)
        logger.info("session %s: base %s, %s weights", job.job_id, base_model, args.adapter_type)
        return SessionResponse(session_id=job.job_id, model_name=job.job_id, status=status.status, version=0)

    def session(self, session_id: str) -> JobDir:
        """The session's job dir; NotFound for unknown ids, InvalidRequest for a plain training job."""
        job = self.jobs.job(session_id)
        if not job.read_config().session:
            raise InvalidRequest(f"job {session_id!r} is a training job, not an RL session", param="session_id")
        return job

    def describe(self, session_id: str) -> SessionResponse:
        """Status and current version."""
        job = self.session(session_id)
        status = job.read_status()
        version = self.catalog.version_of(session_id) if self.catalog.refresh_job(session_id) else 0
        reason = status.reason if status.terminal else None
        return SessionResponse(session_id=session_id, model_name=session_id, status=status.status, version=version,
                               reason=reason)  # fmt: skip

    async def step(self, session_id: str, request: SessionStepRequest) -> SessionStepResponse:
        """Write request-<k>, wait for result-<k>, publish the new version to the catalog."""
        for i, row in enumerate(request.rows):
            check_row(i, row)
        job = await asyncio.to_thread(self.session, session_id)
        lock = self._step_locks.setdefault(session_id, asyncio.Lock())
        async with lock:
            status = await asyncio.to_thread(job.read_status)
            if status.terminal:
                raise Conflict(_ended(session_id, status), param="session_id")
            files = SessionDir(job)
            if files.end_requested():
                raise Conflict(f"session {session_id} is ending", param="session_id")
            k = await asyncio.to_thread(files.next_request_index)
            await asyncio.to_thread(files.write_request, k, request.rows)
            result = await self._wait_result(job, files, k, request.wait_seconds)
        if result.error:
            raise InvalidRequest(f"session {session_id} step {k}: {result.error}", param="rows")
        version = result.version
        try:
            version = max(version, await asyncio.to_thread(self.catalog.published, session_id, result.version))
        except ScalarLMError as e:  # the result is what the trainer says; the catalog catches up on its poll
            logger.warning("session %s: step %d published but not readable yet: %s", session_id, k, e)
        return SessionStepResponse(
            session_id=session_id, model_name=session_id, step=result.step, version=version,
            loss=result.loss, metrics=result.metrics,
        )  # fmt: skip

    async def _wait_result(self, job: JobDir, files: SessionDir, k: int, wait_seconds: float) -> SessionStepResult:
        """Poll for result-<k> every 20 ms; fail fast when the trainer has ended, or after `wait_seconds`."""
        deadline = time.monotonic() + wait_seconds
        next_status = time.monotonic() + STATUS_POLL_SECONDS
        path = files.result_path(k)
        while True:
            if path.exists():
                result = await asyncio.to_thread(files.read_result, k)
                if result is not None:
                    return result
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_POLL_SECONDS
                status = await asyncio.to_thread(job.read_status)
                if status.terminal and not path.exists():
                    raise EngineUnavailable(_ended(job.job_id, status))
            if now >= deadline:
                raise EngineUnavailable(
                    f"session {job.job_id}: step {k} did not finish within {wait_seconds:g} s "
                    "(the trainer is still working on it; the next step waits behind it)"
                )
            await asyncio.sleep(RESULT_POLL_SECONDS)

    async def end(self, session_id: str) -> SessionResponse:
        """Write `end`, wait briefly for the trainer to finish, cancel it if it does not."""
        job = await asyncio.to_thread(self.session, session_id)
        files = SessionDir(job)
        if not (await asyncio.to_thread(job.read_status)).terminal:
            await asyncio.to_thread(files.request_end)
            deadline = time.monotonic() + END_WAIT_SECONDS
            while time.monotonic() < deadline:
                if (await asyncio.to_thread(job.read_status)).terminal:
                    break
                await asyncio.sleep(0.1)
            else:
                logger.warning("session %s: no exit %.0f s after `end`; cancelling", session_id, END_WAIT_SECONDS)
                await asyncio.to_thread(self.jobs.cancel, session_id)
        self._step_locks.pop(session_id, None)
        return await asyncio.to_thread(self.describe, session_id)


def _ended(session_id: str, status: JobStatus) -> str:
    reason = f": {status.reason}" if status.reason else ""
    return f"session {session_id} has ended ({status.status}{reason})"
