"""RL sessions: a long-lived trainer that takes one optimizer step per submitted batch, publishing after each.

A session is a training job with `session=True`, launched like any other. The control plane talks to it
through files (`scalarlm.checkpoint.session`): it writes `meta-<k>.json` and `request-<k>.jsonl`, the trainer
takes one step, publishes `checkpoints/step-<version>` and writes `result-<k>.json`; an `end` file ends it.

Steps overlap generation: up to `max_staleness + 1` requests may be in flight (one training, the rest queued in
the session dir, taken in order), so a client submits batch k+1 while step k trains. The trainer measures each
batch's staleness (its weights version minus the version that generated the batch) and refuses, or re-weights,
one beyond the bound; the control plane refuses one that is already too old on arrival. Waiting for a result
never blocks the event loop: the file is polled with `asyncio.sleep` in between.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.session import SessionDir, batch_version, stale_message
from scalarlm.protocol.errors import Conflict, EngineUnavailable, InvalidRequest, NotFound, QueueFull, ScalarLMError
from scalarlm.protocol.training import (
    MAX_STEPS,
    JobStatus,
    SessionCreateRequest,
    SessionRequestMeta,
    SessionResponse,
    SessionStepRequest,
    SessionStepResponse,
    SessionStepResult,
    SessionStepState,
    TrainJobConfig,
)
from scalarlm.protocol.rows import check_groups, check_step_rows, group_count
from scalarlm.server.jobs import TrainingJobs, new_job_id, parse_train_args
from scalarlm.server.models import ModelCatalog

logger = logging.getLogger(__name__)

# The published steps an RL session keeps unless its train args say otherwise (ScalarLM's max_checkpoints_to_keep
# default): an 8B model in bf16 is 16 GB a step, and only the newest is served.
SESSION_CHECKPOINTS_KEPT = 3
RESULT_POLL_SECONDS = 0.02
STATUS_POLL_SECONDS = 0.5
END_WAIT_SECONDS = 10.0


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
        params.setdefault("loss", "grpo")  # an RL session: scored rows, GRPO; SFT rows only with loss "sft"
        if params.get("lr_schedule", "constant") != "constant" and "max_steps" not in params:
            raise InvalidRequest(f"lr_schedule {params['lr_schedule']!r} decays over max_steps, and a session is "
                                 "open-ended unless it names them: send max_steps (the session then takes that many "
                                 "steps), or leave lr_schedule at 'constant'", param="train_args")  # fmt: skip
        params.setdefault("lr_schedule", "constant")
        params.setdefault("max_steps", MAX_STEPS)  # open-ended; with max_steps set, the steps past it are refused
        # Open-ended in time too: only the operator's cap (and `session_idle_seconds` without a request) ends it.
        params.setdefault("timeout", self.jobs.settings.training.max_train_seconds)
        # A session publishes every step: it keeps the newest few on disk unless told (None: every step).
        params.setdefault("max_checkpoints_to_keep", SESSION_CHECKPOINTS_KEPT)
        if request.model_name is not None:
            params.setdefault("llm_name", request.model_name)
        args = parse_train_args(params, self.jobs.settings.training)
        if request.stale_policy == "reweight" and args.loss == "sft":
            raise InvalidRequest("stale_policy 'reweight' trains a stale batch with its importance ratio against the "
                                 "rows' sampling logprobs, a GRPO objective: a loss 'sft' session can only refuse "
                                 "stale batches (stale_policy 'refuse')", param="stale_policy")  # fmt: skip
        if args.num_iterations > 1:
            raise InvalidRequest("num_iterations > 1 is not supported for RL sessions: each step request is one "
                                 "optimizer step; send the batch again for another", param="train_args")  # fmt: skip
        base_model = self.jobs.base_model_for(args.llm_name)
        job = JobDir.under(self.jobs.settings.jobs_dir, new_job_id().replace("job-", "session-", 1))
        job.create()
        try:
            base_model = self.jobs.own_base(job, base_model)
        except OSError:
            shutil.rmtree(job.root, ignore_errors=True)
            raise
        SessionDir(job).create()
        job.dataset_path.write_text("")
        idle = self.jobs.settings.training.session_idle_seconds
        config = TrainJobConfig(
            job_id=job.job_id, base_model=base_model, train_args=args, created=time.time(), session=True,
            session_idle_seconds=idle or None,  # the trainer ends itself after this long without a step request
            session_max_staleness=request.max_staleness, session_stale_policy=request.stale_policy,
        )  # fmt: skip
        status = self.jobs.launch(job, config)
        logger.info("session %s: base %s, %s weights, max_staleness %d (%s)", job.job_id, base_model,
                    args.adapter_type, request.max_staleness, request.stale_policy)  # fmt: skip
        return SessionResponse(session_id=job.job_id, model_name=job.job_id, status=status.status, version=0,
                               max_staleness=request.max_staleness, stale_policy=request.stale_policy)  # fmt: skip

    def session(self, session_id: str) -> tuple[JobDir, TrainJobConfig]:
        """The session's job dir and config; NotFound for unknown ids, InvalidRequest for a plain training job."""
        job = self.jobs.job(session_id)
        config = job.read_config()
        if not config.session:
            raise InvalidRequest(f"job {session_id!r} is a training job, not an RL session", param="session_id")
        return job, config

    def describe(self, session_id: str) -> SessionResponse:
        """Status and current version."""
        job, config = self.session(session_id)
        status = job.read_status()
        version = self.catalog.version_of(session_id) if self.catalog.refresh_job(session_id) else 0
        reason = status.reason if status.terminal else None
        return SessionResponse(session_id=session_id, model_name=session_id, status=status.status, version=version,
                               reason=reason, max_staleness=config.session_max_staleness,
                               stale_policy=config.session_stale_policy)  # fmt: skip

    async def step(self, session_id: str, request: SessionStepRequest) -> SessionStepResponse:
        """Queue the step (waiting for a free slot when `max_staleness + 1` are in flight) and wait for its result."""
        deadline = time.monotonic() + request.wait_seconds
        state = await self._accept(session_id, request, deadline, overlap=request.overlap is True)
        response = await self.result(session_id, state.request, max(0.0, deadline - time.monotonic()))
        if response is None:
            raise EngineUnavailable(
                f"session {session_id}: step {state.request} did not finish within {request.wait_seconds:g} s "
                "(the trainer is still working on it; the next step waits behind it)"
            )
        return response

    async def submit(self, session_id: str, request: SessionStepRequest) -> SessionStepState:
        """Queue the step and answer at once (429 when `max_staleness + 1` steps are already in flight)."""
        return await self._accept(session_id, request, None, overlap=request.overlap is not False)

    async def state(self, session_id: str, k: int, wait_seconds: float) -> SessionStepState:
        """Where request k stands, waiting up to `wait_seconds` for its result; a refused step raises its error."""
        job, _ = await asyncio.to_thread(self.session, session_id)
        files = SessionDir(job)
        if not files.request_path(k).exists():
            raise NotFound(f"session {session_id} has no step request {k}", param="request")
        accepted = (await asyncio.to_thread(files.read_meta, k)).accepted
        response = await self.result(session_id, k, wait_seconds)
        return SessionStepState(session_id=session_id, request=k, state="queued" if response is None else "trained",
                                accepted=accepted, result=response)  # fmt: skip

    async def _accept(self, session_id: str, request: SessionStepRequest, deadline: float | None,
                      overlap: bool) -> SessionStepState:  # fmt: skip
        """Validate, then write meta-<k> and request-<k> once fewer than `max_staleness + 1` steps are in flight
        (`overlap`: the request's, resolved for its route)."""
        job, config = await asyncio.to_thread(self.session, session_id)
        check_step_rows(request.rows, config.train_args.loss, config.train_args.mask_truncated_completions)
        if config.train_args.loss != "sft":
            check_groups(len(request.rows), group_count(request.rows), config.train_args.kl_coef, "rows", "rows")
        files = SessionDir(job)
        generated = batch_version(request.version, request.rows)
        slots = config.session_max_staleness + 1
        lock = self._step_locks.setdefault(session_id, asyncio.Lock())
        while True:
            async with lock:
                status = await asyncio.to_thread(job.read_status)
                if status.terminal:
                    raise Conflict(_ended(session_id, status), param="session_id")
                if files.end_requested():
                    raise Conflict(f"session {session_id} is ending", param="session_id")
                pending = await asyncio.to_thread(files.pending)
                if len(pending) < slots:
                    await asyncio.to_thread(self._check_next, session_id, files, config, generated, len(pending))
                    k = files.next_request_index()
                    meta = SessionRequestMeta(version=generated, accepted=time.time(), overlap=overlap)
                    await asyncio.to_thread(files.write_request, k, request.rows, meta)
                    return SessionStepState(session_id=session_id, request=k, state="queued", accepted=meta.accepted)
            if deadline is None:
                raise QueueFull(
                    f"session {session_id} has {len(pending)} steps in flight (requests {pending}), the most its "
                    f"max_staleness {config.session_max_staleness} allows; wait for step {pending[0]} first",
                    param="rows", retry_after=1.0,
                )  # fmt: skip
            if time.monotonic() >= deadline:
                raise EngineUnavailable(f"session {session_id}: no free step slot (requests {pending} in flight)")
            await asyncio.sleep(RESULT_POLL_SECONDS)

    @staticmethod
    def _check_next(session_id: str, files: SessionDir, config: TrainJobConfig, generated: int | None,
                    in_flight: int) -> None:  # fmt: skip
        """Refuse at once a step past the session's `max_steps`, and a batch already too stale for the newest result
        (the trainer checks staleness again exactly)."""
        last = files.last_result_index()
        result = files.read_result(last) if last else None
        current = result.version if result is not None else 0
        limit = config.train_args.max_steps
        if current + in_flight >= limit:
            raise Conflict(f"session {session_id} has taken its max_steps {limit} steps (version {current}, "
                           f"{in_flight} more in flight): end it, or create a session with more", param="rows")
        if generated is None or config.session_stale_policy != "refuse":
            return
        if current - generated > config.session_max_staleness:
            raise Conflict(stale_message(session_id, generated, current, config.session_max_staleness),
                           param="version")  # fmt: skip

    async def result(self, session_id: str, k: int, wait_seconds: float) -> SessionStepResponse | None:
        """Step k's answer once trained (None after `wait_seconds`); its error if refused or the trainer ended."""
        job, _ = await asyncio.to_thread(self.session, session_id)
        files = SessionDir(job)
        result = await self._wait_result(job, files, k, wait_seconds)
        if result is None:
            return None
        if result.error:
            message = f"session {session_id} step {k}: {result.error}"
            if result.error_type == "stale":
                raise Conflict(message, param="version")
            raise InvalidRequest(message, param="rows")
        # The version this step published: with steps pipelined, a later step may already be newer when this
        # answer is read, and the catalog's current version would name that one.
        version = result.version
        try:
            await asyncio.to_thread(self.catalog.published, session_id, result.version)
        except ScalarLMError as e:  # the result is what the trainer says; the catalog catches up on its poll
            logger.warning("session %s: step %d published but not readable yet: %s", session_id, k, e)
        return SessionStepResponse(
            session_id=session_id, model_name=session_id, step=result.step, version=version,
            loss=result.loss, metrics=result.metrics, request=k, generated_version=result.generated_version,
            staleness=result.staleness,
        )  # fmt: skip

    async def _wait_result(self, job: JobDir, files: SessionDir, k: int,
                           wait_seconds: float) -> SessionStepResult | None:  # fmt: skip
        """Poll for result-<k> every 20 ms; fail fast when the trainer has ended; None after `wait_seconds`."""
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
                return None
            await asyncio.sleep(RESULT_POLL_SECONDS)

    async def end(self, session_id: str) -> SessionResponse:
        """Write `end`; the trainer answers its queued steps first. Cancel it if it goes `END_WAIT_SECONDS` without
        finishing a step or exiting."""
        job, _ = await asyncio.to_thread(self.session, session_id)
        files = SessionDir(job)
        if not (await asyncio.to_thread(job.read_status)).terminal:
            await asyncio.to_thread(files.request_end)
            deadline = time.monotonic() + END_WAIT_SECONDS
            answered = await asyncio.to_thread(files.last_result_index)
            while time.monotonic() < deadline:
                if (await asyncio.to_thread(job.read_status)).terminal:
                    break
                await asyncio.sleep(0.1)
                if (latest := await asyncio.to_thread(files.last_result_index)) > answered:
                    answered, deadline = latest, time.monotonic() + END_WAIT_SECONDS  # still working through the queue
            else:
                logger.warning("session %s: no exit %.0f s after `end`; cancelling", session_id, END_WAIT_SECONDS)
                await asyncio.to_thread(self.jobs.cancel, session_id)
        self._step_locks.pop(session_id, None)
        return await asyncio.to_thread(self.describe, session_id)


def _ended(session_id: str, status: JobStatus) -> str:
    reason = f": {status.reason}" if status.reason else ""
    return f"session {session_id} has ended ({status.status}{reason})"
