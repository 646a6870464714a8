"""Reconciliation: a job whose status says QUEUED/RUNNING but whose processes are gone is settled.

It becomes CANCELLED (a cancel was asked), is relaunched from its saved state (the control plane's shutdown stopped
it, or it crashed and the resume policy says so), or becomes FAILED with why. `resume_job` is also the manual
resume of a FAILED or CANCELLED job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from scalarlm.checkpoint import JobDir, latest_step, repair_latest
from scalarlm.checkpoint.staging import land_orphaned
from scalarlm.config import TrainingSettings
from scalarlm.launcher.base import Launcher, cancel_requested, log_path, read_record, shutdown_requested
from scalarlm.protocol.errors import ScalarLMError
from scalarlm.protocol.training import JobStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePolicy:
    """Which jobs whose processes are gone get relaunched from their saved state."""

    interrupted: bool = True  # stopped by the control plane's own shutdown (they wait QUEUED)
    crashed: bool = False  # died without a final status
    max_resumes: int = 3  # automatic relaunches of one job (a crash loop ends FAILED)

    @classmethod
    def from_settings(cls, training: TrainingSettings) -> "ResumePolicy":
        return cls(training.resume != "none", training.resume == "all", training.max_resumes)


def saved_state_step(job: JobDir) -> int | None:
    """The step of the newest complete resume state (`state/latest.json`), or None."""
    try:
        return int(json.loads((job.state_dir / "latest.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_job(job: JobDir, launcher: Launcher, why: str) -> JobStatus:
    """Relaunch `job` on its own directory: the trainer continues from its saved state (from step 0 if none)."""
    config = job.read_config()
    for marker in (job.cancel_marker, job.shutdown_marker):
        marker.unlink(missing_ok=True)
    saved = saved_state_step(job)
    where = f"from the state saved at step {saved}" if saved is not None else "from the start (no saved state)"
    reason = f"resuming {where}: {why}"
    log_path(job).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path(job), "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {reason} ===\n")
    status = job.update_status(status="QUEUED", reason=reason, end_time=None, resumes=job.read_status().resumes + 1)
    try:
        launcher_id = launcher.submit(job, config)
    except (OSError, ScalarLMError) as e:  # no trainer could start, or the launcher now refuses the job
        return job.update_status(status="FAILED", reason=f"could not relaunch the trainer: {e}", end_time=time.time())
    logger.info("job %s: %s (resume %d)", job.job_id, reason, status.resumes)
    return job.update_status(launcher_id=launcher_id)


def last_step(job: JobDir, status: JobStatus) -> int:
    """The last step the job reached, from its status or its metrics."""
    steps = [status.step] + [int(row["step"]) for row in job.read_metrics() if isinstance(row.get("step"), int)]
    return max(steps)


def last_log_line(job: JobDir, max_chars: int = 300) -> str | None:
    """The last non-blank line the trainer printed (usually the error), for the failure reason."""
    candidates = [log_path(job), job.rank_log(0)]
    for path in candidates:
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            lines = [ln.strip() for ln in f.read().decode("utf-8", errors="replace").splitlines() if ln.strip()]
        if lines:
            return lines[-1][:max_chars]
    return None


def failure_reason(job: JobDir, status: JobStatus, launcher_reason: str | None) -> str:
    """'trainer process 123 exited with code 1 without a final status; last step 4; last output: ...'."""
    what = launcher_reason or "the trainer's processes are gone"
    reason = f"{what} without a final status; last step {last_step(job, status)}"
    saved = latest_step(job)
    if saved is not None:
        reason += f" (checkpoint step-{saved})"
    line = last_log_line(job)
    if line:
        reason += f"; last output: {line}"
    return reason


def reconcile_job(
    job: JobDir, launchers: Mapping[str, Launcher], policy: ResumePolicy = ResumePolicy()
) -> JobStatus | None:
    """Settle one job if its processes are gone; return the new status when it changed."""
    if not job.status_path.exists():
        return None
    status = job.read_status()
    if status.terminal:
        return None
    record = read_record(job)
    if record is None:
        reason = "the control plane stopped before the job was handed to a launcher"
        return job.update_status(status="FAILED", reason=reason, end_time=time.time())
    launcher = launchers.get(record.launcher)
    if launcher is None:
        return None  # launched by a kind this control plane does not run; leave it to one that does
    state, why = launcher.state(job)
    if state == "unknown" and shutdown_requested(job):
        # The control plane that left the marker waited for the trainer (or killed it) before it exited: the
        # process is gone even when it ran on another host (a rescheduled pod has a new host name).
        state, why = "finished", "the trainer was stopped by the control plane's shutdown"
    if state != "finished":
        return None
    # The trainer may have died between a checkpoint's rename and the pointer's update, or before the durable copy of
    # a staged step landed.
    repair_latest(job)
    try:
        land_orphaned(job)
    except OSError as e:  # the staged copy stays servable; the job still gets its final status
        logger.warning("job %s: could not land its staged checkpoint: %s", job.job_id, e)
    status = job.read_status()  # the trainer may have written its final status as it exited
    if status.terminal:
        return None
    if cancel_requested(job):
        return job.update_status(status="CANCELLED", reason="cancelled by user", end_time=time.time())
    if shutdown_requested(job):
        stopped = f"stopped at step {status.step} by the control plane's shutdown"
        if policy.interrupted:
            return resume_job(job, launcher, stopped)
        job.shutdown_marker.unlink(missing_ok=True)
        reason = f"{stopped}; state saved, POST /v1/megatron/resume/{job.job_id} continues it"
        return job.update_status(status="FAILED", reason=reason, end_time=time.time())
    reason = failure_reason(job, status, why)
    if policy.crashed and status.resumes < policy.max_resumes:
        logger.warning("job %s: %s", job.job_id, reason)
        return resume_job(job, launcher, f"the trainer crashed ({reason})")
    if policy.crashed:
        reason += f"; not resumed again after {status.resumes} resumes"
    logger.warning("job %s: %s", job.job_id, reason)
    return job.update_status(status="FAILED", reason=reason, end_time=time.time())


def reconcile(
    jobs_dir: Path, launchers: Mapping[str, Launcher], policy: ResumePolicy = ResumePolicy()
) -> list[JobStatus]:
    """Settle every job under `jobs_dir` whose processes are gone; return the statuses that changed."""
    changed = []
    if not jobs_dir.exists():
        return changed
    for root in sorted(p for p in jobs_dir.iterdir() if p.is_dir()):
        try:
            new = reconcile_job(JobDir(root), launchers, policy)
        except (OSError, ValueError) as e:  # a half-written or foreign directory must not stop the sweep
            logger.warning("reconcile: skipping %s: %s", root, e)
            continue
        if new is not None:
            changed.append(new)
    return changed
