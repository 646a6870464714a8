"""The training-job registry: submit (validate, write `jobs/<id>/`, launch), describe, cancel, delete, reconcile.

Job directories are the only record: any control plane pointed at the same `$SCALARLM_HOME` sees the
same jobs, and `reconciling()` settles jobs whose processes died (on start and every poll period).
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import threading
import time
import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from scalarlm.server.periodic import every
from scalarlm.server.training_uploads import UploadSessions
from scalarlm.checkpoint import JobDir, latest_step, list_steps, read_manifest
from scalarlm.checkpoint.hub_cache import has_chat_template, resolve_model
from scalarlm.config import Settings, TrainingSettings, gpu_memory_split, host_cores, trainer_cpu_threads
from scalarlm.launcher import (
    Launcher,
    ResumePolicy,
    default_launchers,
    extract_dataset,
    mark_cancelled,
    read_record,
    reconcile,
    resume_job,
)
from scalarlm.launcher.model_check import check_base_model
from scalarlm.protocol.errors import Conflict, EngineUnavailable, InvalidRequest, NotFound, ScalarLMError
from scalarlm.protocol.rows import check_groups, first_row_scored, summarize_dataset
from scalarlm.protocol.training import (
    NAME_PATTERN,
    DeleteJobResponse,
    JobStatus,
    ListModelsResponse,
    ModelEntry,
    TrainArgs,
    TrainingJobResponse,
    TrainJobConfig,
    TrainResponse,
)

logger = logging.getLogger(__name__)


# ScalarLM's name for the newest submitted job in reads (see `TrainingJobs.resolve`).
LATEST = "latest"
UPLOAD_SWEEP_SECONDS = 60.0  # how often abandoned chunked uploads are looked for (also once at start)


def new_job_id() -> str:
    """A fresh id for every submission (resubmitting the same data and args trains again)."""
    return f"job-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def train_params(params: str | dict[str, Any] | None) -> dict[str, Any]:
    """The submitted train args as a dict (JSON text decoded); 400 unless they are a JSON object."""
    if isinstance(params, str):
        try:
            params = json.loads(params) if params.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"params is not valid JSON: {e.msg}", param="params") from None
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InvalidRequest("params must be a JSON object of train args", param="params")
    return params


def parse_train_args(params: str | dict[str, Any] | None, training: TrainingSettings) -> TrainArgs:
    """Validate train args, with the resources a submission leaves out taken from the server's `training` settings;
    400 naming the unknown key or the field with a wrong value."""
    try:
        return TrainArgs.model_validate(with_cluster_defaults(train_params(params), training))
    except ValidationError as e:
        raise _describe(e) from None


def args_before_rows(params: dict[str, Any], training: TrainingSettings) -> TrainArgs:
    """A job's args checked before its rows are read: without a `loss` the rows choose it (GRPO when they carry a
    `reward`), so they are checked as GRPO's, which accepts every SFT setting and GRPO's own; `submit` checks them
    again with the loss the rows chose."""
    return parse_train_args(params if "loss" in params else {**params, "loss": "grpo"}, training)


def check_servable(args: TrainArgs, settings: Settings) -> None:
    """InvalidRequest for a LoRA adapter of a higher rank than this server's engine loads (`engine.max_lora_rank`,
    vLLM's --max-lora-rank): it would train, then fail every request for it."""
    engine = settings.engine
    r = args.lora_config.r
    if args.adapter_type == "lora" and engine.enable_lora and r > engine.max_lora_rank:
        raise InvalidRequest(f"lora_config.r {r} is above this server's engine.max_lora_rank {engine.max_lora_rank}, "
                             "so its engine could not load the adapter to serve it: send r <= "
                             f"{engine.max_lora_rank}, or start the server with engine.max_lora_rank >= {r} "
                             "(SCALARLM_ENGINE__MAX_LORA_RANK)", param="lora_config")  # fmt: skip


def with_cluster_defaults(params: dict[str, Any], training: TrainingSettings) -> dict[str, Any]:
    """Fill `gpus` and `cpu_ranks` when the submission leaves them out: on a GPU cluster (`gpus_per_node` > 0) a
    job gets one GPU per tensor-parallel rank (ScalarLM's default is one GPU); on CPU, `training.cpu_ranks`."""
    params = dict(params)
    if "gpus" not in params and training.gpus_per_node > 0:
        tp = params.get("tensor_parallel_size", 1)
        params["gpus"] = tp if isinstance(tp, int) and tp > 0 else 1
    params.setdefault("cpu_ranks", training.cpu_ranks)
    return params


def _describe(error: ValidationError) -> InvalidRequest:
    parts, first = [], None
    for err in error.errors()[:5]:
        key = ".".join(str(p) for p in err["loc"])
        first = first or key or "params"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown train arg {key!r}")
        elif key:
            parts.append(f"train arg {key!r}: {err['msg']} (got {err.get('input')!r})")
        else:
            parts.append(f"train args: {err['msg']}")
    return InvalidRequest("; ".join(parts), param=first)


def history(job: JobDir) -> list[dict[str, Any]]:
    """ScalarLM's `history`: {step, loss, time} per metrics row (its SDK plots this)."""
    return [
        {"step": row["step"], "loss": row.get("loss"), "time": row.get("time")}
        for row in job.read_metrics()
        if "step" in row
    ]


class TrainingJobs:
    """Training jobs under `settings.jobs_dir`, launched through the configured launchers."""

    def __init__(self, settings: Settings, launchers: Mapping[str, Launcher] | None = None) -> None:
        self.settings = settings
        self.launchers = dict(launchers) if launchers is not None else default_launchers(settings)
        # Held while a job goes from QUEUED-on-disk to launched, and while reconciling, so the sweep never
        # mistakes a job being launched for one whose launch was lost.
        self._lock = threading.Lock()

    @property
    def uploads_dir(self) -> Path:
        return self.settings.home / "uploads"

    # --- submission -------------------------------------------------------------------------------

    def base_model_for(self, llm_name: str | None) -> str:
        """The model a job starts from: the served base model, a finished full-weight job's checkpoint, a local
        model directory, or a hub id in the local Hugging Face cache (400 naming it when it is none of these)."""
        settings = self.settings
        base = Path(settings.model)
        names = {settings.model, settings.base_model_name, str(base.resolve()) if base.exists() else settings.model}
        if llm_name is None or llm_name in names:
            return str(resolve_model(settings.model, settings.hf_cache, param="model"))
        if NAME_PATTERN.match(llm_name) and (settings.jobs_dir / llm_name).is_dir():
            job = JobDir.under(settings.jobs_dir, llm_name)
            step = latest_step(job)
            if step is not None and read_manifest(job, step).kind == "full":
                return str(job.step_dir(step))
            raise InvalidRequest(
                f"llm_name {llm_name!r} has no full-weight checkpoint to train from", param="llm_name"
            )
        return str(resolve_model(llm_name, settings.hf_cache, param="llm_name"))

    def own_base(self, job: JobDir, base_model: str) -> str:
        """`base_model` as `job` reads it: another job's published step is linked into the job (`JobDir.own_base`),
        as that job may prune or delete it; any other base as it is."""
        path = Path(base_model)
        if not path.is_dir() or not path.resolve().is_relative_to(self.settings.jobs_dir.resolve()):
            return base_model
        return str(job.own_base(path))

    def launcher_for(self, args: TrainArgs) -> Launcher:
        name = args.launcher or self.settings.training.launcher
        launcher = self.launchers.get(name)
        if launcher is None:
            raise InvalidRequest(f"launcher {name!r} is not available on this server", param="launcher")
        return launcher

    def submit(self, upload: Path, params: str | dict[str, Any] | None) -> TrainResponse:
        """Validate args, dataset and model; write `jobs/<id>/`; launch. Any error leaves no job behind.

        Without a `loss`, the rows choose it: GRPO when they carry a `reward`, else SFT (`args_before_rows`)."""
        params = train_params(params)
        args = args_before_rows(params, self.settings.training)
        base_model = self.base_model_for(args.llm_name)
        launcher = self.launcher_for(args)
        check_base_model(base_model, args)  # the trainer's family rules: refuse before anything is written
        check_servable(args, self.settings)
        job = JobDir.under(self.settings.jobs_dir, new_job_id())
        job.create()
        try:
            base_model = self.own_base(job, base_model)
            extract_dataset(upload, job.dataset_path, self.settings.upload.max_upload_bytes)
            if "loss" not in params:
                loss = "grpo" if first_row_scored(job.dataset_path) else "sft"
                args = parse_train_args({**params, "loss": loss}, self.settings.training)
            summary = summarize_dataset(job.dataset_path, args.loss, args.mask_truncated_completions)
            if summary.first_chat_line is not None and not has_chat_template(Path(base_model)):
                raise InvalidRequest(f"dataset line {summary.first_chat_line}: chat rows need a chat template, and "
                                     f"base model {base_model} has none", param="dataset")  # fmt: skip
            if args.loss != "sft":
                check_groups(summary.rows, summary.groups, args.kl_coef, "dataset", "dataset")
            rows = summary.rows
            config = TrainJobConfig(
                job_id=job.job_id, base_model=base_model, train_args=args, dataset_rows=rows, created=time.time()
            )
            status = self._launch(job, config, launcher)
        except (ScalarLMError, OSError):
            shutil.rmtree(job.root, ignore_errors=True)
            raise
        logger.info("job %s: %d rows, base %s, launched by %s as %s", job.job_id, rows, base_model,
                    launcher.name, status.launcher_id)  # fmt: skip
        return TrainResponse(
            job_status=self._status_body(job, status), job_config=self._config_body(job, config), deployed=False
        )

    def launch(self, job: JobDir, config: TrainJobConfig) -> JobStatus:
        """Write `config` into an already created job dir and start its trainer (RL sessions use this)."""
        try:
            check_base_model(config.base_model, config.train_args)
            check_servable(config.train_args, self.settings)
            return self._launch(job, config, self.launcher_for(config.train_args))
        except ScalarLMError:
            shutil.rmtree(job.root, ignore_errors=True)
            raise

    def _beside_engine(self, launcher: Launcher) -> bool:
        """True when the job's ranks run on this node (its GPUs, or its cores) beside the embedded vLLM engine."""
        return self.settings.server.role == "embedded" and launcher.name == "local"

    def _launch(self, job: JobDir, config: TrainJobConfig, launcher: Launcher) -> JobStatus:
        limit = min(config.train_args.timeout, self.settings.training.max_train_seconds)
        args = config.train_args
        beside_engine = self._beside_engine(launcher)
        share = gpu_memory_split(self.settings).trainer if args.gpus > 0 and beside_engine else 0.0
        threads = partial(trainer_cpu_threads, self.settings, ranks=args.world_size, cores=host_cores(),
                          cpu_job=args.gpus == 0, beside_engine=beside_engine)  # fmt: skip
        overlaps = config.session and config.session_max_staleness > 0
        config = config.model_copy(update={
            "max_train_seconds": float(limit),  # the trainer stops itself there
            "gpu_memory_fraction": share or None,  # its ranks leave the engine its share of each GPU
            "cpu_threads": threads(overlaps=False),
            # a session step that overlaps generation leaves the CPU engine its cores
            "cpu_threads_overlapped": threads(overlaps=True) if overlaps else None,
        })  # fmt: skip
        job.write_config(config)
        with self._lock:
            args = config.train_args
            job.write_status(JobStatus(job_id=job.job_id, max_steps=args.max_steps, launcher=launcher.name))
            try:
                launcher_id = launcher.submit(job, config)
            except OSError as e:
                raise EngineUnavailable(f"could not start the trainer: {e}") from e
            return job.update_status(launcher_id=launcher_id)

    # --- reading ----------------------------------------------------------------------------------

    def is_running(self, job_id: str) -> bool:
        """Whether the job exists and has not ended (what counts against a key's `max_jobs`)."""
        try:
            return not self.job(job_id).read_status().terminal
        except ScalarLMError:  # deleted
            return False

    def job(self, job_id: str) -> JobDir:
        """The job's directory; NotFound for an unknown (or unsafe) id."""
        if not NAME_PATTERN.match(job_id) or ".." in job_id:
            raise NotFound(f"training job {job_id!r} does not exist", param="job_id")
        job = JobDir.under(self.settings.jobs_dir, job_id)
        if not job.status_path.exists():
            raise NotFound(f"training job {job_id!r} does not exist", param="job_id")
        return job

    def resolve(self, name: str) -> str:
        """The job a read names. ScalarLM's `latest` (its SDK CLI's default for `logs` and `plot`) is the newest
        submitted job, unless a job has that name."""
        if name != LATEST or (self.settings.jobs_dir / name / "status.json").exists():
            return name
        newest = max(self._configs(), key=lambda pair: pair[1].created, default=None)
        if newest is None:
            raise NotFound("no training job was submitted yet, so 'latest' names none", param="job_id")
        return newest[0].job_id

    def _configs(self) -> list[tuple[JobDir, TrainJobConfig]]:
        """Every readable job with its config (an unreadable one is logged and left out)."""
        jobs_dir = self.settings.jobs_dir
        found = []
        for root in [p for p in jobs_dir.iterdir() if (p / "status.json").exists()] if jobs_dir.exists() else []:
            try:
                found.append((JobDir(root), JobDir(root).read_config()))
            except (OSError, ValueError) as e:
                logger.warning("skipping job %s: %s", root, e)
        return found

    def _status_body(self, job: JobDir, status: JobStatus) -> dict[str, Any]:
        body = status.model_dump(mode="json")
        body.update(job_directory=str(job.root), model_name=job.job_id)
        return body

    def _config_body(self, job: JobDir, config: TrainJobConfig) -> dict[str, Any]:
        body = config.model_dump(mode="json")
        body["job_directory"] = str(job.root)
        return body

    def describe(self, job_id: str) -> TrainingJobResponse:
        """Status (with loss history), config, published checkpoints and the latest metrics row."""
        job = self.job(self.resolve(job_id))
        metrics = job.read_metrics()
        status = self._status_body(job, job.read_status())
        status["history"] = history(job)
        steps = list_steps(job)
        return TrainingJobResponse(
            job_status=status,
            job_config=self._config_body(job, job.read_config()),
            deployed=bool(steps),
            checkpoints=steps,
            metrics_count=len(metrics),
            last_metrics=metrics[-1] if metrics else None,
        )

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return self.job(self.resolve(job_id)).read_metrics()

    def logs(self, job_id: str) -> str:
        job = self.job(self.resolve(job_id))
        record = read_record(job)
        launcher = self.launchers.get(record.launcher if record else self.settings.training.launcher)
        if launcher is None:
            return ""
        return launcher.logs(job)

    def list_models(self) -> ListModelsResponse:
        """Every job, newest first (as ScalarLM's, whose CLI `ls -l N` shows the first N), with its progress and newest
        checkpoint; then the base model."""
        entries = []
        for job, config in sorted(self._configs(), key=lambda pair: pair[1].created, reverse=True):
            try:
                entries.append(self._entry(job, config))
            except (OSError, ValueError) as e:
                logger.warning("list_models: skipping %s: %s", job.root, e)
        base = ModelEntry(name=self.settings.base_model_name, deployed=True, status="READY", kind="base")
        return ListModelsResponse(models=[*entries, base])

    def _entry(self, job: JobDir, config: TrainJobConfig) -> ModelEntry:
        status = job.read_status()
        step = latest_step(job)
        train_time = 0.0
        if status.start_time is not None:
            train_time = (status.end_time or time.time()) - status.start_time
        return ModelEntry(
            name=job.job_id, deployed=step is not None, status=status.status,
            start_time=status.start_time if status.start_time is not None else config.created,
            step=status.step, max_steps=status.max_steps or config.train_args.max_steps, train_time=train_time,
            loss=status.loss, version=step or 0, kind="lora" if config.train_args.adapter_type == "lora" else "full",
        )  # fmt: skip

    # --- control ----------------------------------------------------------------------------------

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Stop a queued or running job (the trainer saves its state); a finished job is left as it is."""
        job = self.job(job_id)
        if not job.read_status().terminal:
            record = read_record(job)
            launcher = self.launchers.get(record.launcher) if record else None
            if launcher is not None:
                launcher.cancel(job)
            else:
                mark_cancelled(job)
        return self._status_body(job, job.read_status())

    def resume(self, job_id: str) -> dict[str, Any]:
        """Relaunch a FAILED or CANCELLED job on its own directory, from its saved state; 409 for any other."""
        job = self.job(job_id)
        with self._lock:
            status = job.read_status()
            if status.status == "COMPLETED":
                raise Conflict(f"training job {job_id!r} completed all its steps; to train further, submit a new "
                               f"job with llm_name={job_id!r}", param="job_id")  # fmt: skip
            if not status.terminal:
                raise Conflict(f"training job {job_id!r} is {status.status}; only a FAILED or CANCELLED job resumes",
                               param="job_id")  # fmt: skip
            record = read_record(job)
            name = record.launcher if record is not None else status.launcher or self.settings.training.launcher
            launcher = self.launchers.get(name)
            if launcher is None:
                raise InvalidRequest(f"launcher {name!r} of job {job_id!r} is not available on this server",
                                     param="job_id")  # fmt: skip
            resume_job(job, launcher, f"asked by a user after {status.status}: {status.reason or 'no reason given'}")
        return self._status_body(job, job.read_status())

    def delete(self, job_id: str) -> DeleteJobResponse:
        """Cancel the job if it still runs, then remove its directory."""
        job = self.job(job_id)
        self.cancel(job_id)
        shutil.rmtree(job.root)
        return DeleteJobResponse(job_id=job_id)

    def reconcile(self) -> list[JobStatus]:
        """Settle jobs whose processes are gone: CANCELLED when asked, relaunched when the resume policy says so
        (`training.resume`), else FAILED with the reason."""
        with self._lock:
            changed = reconcile(self.settings.jobs_dir, self.launchers, ResumePolicy.from_settings(self.settings.training))
            for launcher in self.launchers.values():
                for job_id in launcher.admit():
                    logger.info("job %s: a trainer slot is free, started", job_id)
            return changed

    def reconciling(self) -> AbstractAsyncContextManager[None]:
        """Reconcile once now (a restarted control plane) and then every `training.poll_seconds`."""
        return every(self.settings.training.poll_seconds, self.reconcile, "reconcile", (OSError, ScalarLMError))

    @asynccontextmanager
    async def supervising(self) -> AsyncIterator[None]:
        """Reconcile while the app runs; at shutdown stop the trainers that would die with this control plane
        (`training.on_shutdown`), so they save their state and resume on restart."""
        sweep = min(UPLOAD_SWEEP_SECONDS, self.settings.upload.abandoned_upload_seconds / 2)
        async with self.reconciling(), every(sweep, self.remove_abandoned_uploads, "upload sweep"):
            yield
        if self.settings.training.on_shutdown == "checkpoint":
            await asyncio.to_thread(self.stop_for_shutdown)

    def remove_abandoned_uploads(self) -> list[str]:
        """Remove the uploads nothing reached for `upload.abandoned_upload_seconds` (logged)."""
        removed = UploadSessions(self.uploads_dir, self.settings.upload).remove_abandoned()
        if removed:
            logger.info("removed %d abandoned uploads: %s", len(removed), ", ".join(removed))
        return removed

    def stop_for_shutdown(self) -> list[str]:
        """Ask each launcher to stop its jobs that would not survive this process; return the stopped ids."""
        with self._lock:
            by_launcher: dict[str, list[JobDir]] = {}
            jobs_dir = self.settings.jobs_dir
            for root in sorted(p for p in jobs_dir.iterdir() if p.is_dir()) if jobs_dir.exists() else []:
                job = JobDir(root)
                try:
                    record = read_record(job)
                    if record is None or job.read_status().terminal:
                        continue
                except (OSError, ValueError):
                    continue
                by_launcher.setdefault(record.launcher, []).append(job)
            stopped = []
            for name, jobs in by_launcher.items():
                launcher = self.launchers.get(name)
                if launcher is not None:
                    stopped += launcher.stop_for_shutdown(jobs)
        if stopped:
            logger.info("shutdown: stopped %d training jobs with their state saved: %s", len(stopped), ", ".join(stopped))
        return stopped
