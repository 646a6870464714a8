"""Reconciliation: a job whose status says QUEUED/RUNNING but whose processes are gone becomes FAILED, with why."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from scalarlm.checkpoint import JobDir, latest_step
from scalarlm.launcher.base import Launcher, cancel_requested, log_path, read_record
from scalarlm.protocol.training import JobStatus

logger = logging.getLogger(__name__)


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


def reconcile_job(job: JobDir, launchers: Mapping[str, Launcher]) -> JobStatus | None:
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
    if state != "finished":
        return None
    status = job.read_status()  # the trainer may have written its final status as it exited
    if status.terminal:
        return None
    if cancel_requested(job):
        return job.update_status(status="CANCELLED", reason="cancelled by user", end_time=time.time())
    reason = failure_reason(job, status, why)
    logger.warning("job %s: %s", job.job_id, reason)
    return job.update_status(status="FAILED", reason=reason, end_time=time.time())


def reconcile(jobs_dir: Path, launchers: Mapping[str, Launcher]) -> list[JobStatus]:
    """Settle every job under `jobs_dir` whose processes are gone; return the statuses that changed."""
    changed = []
    if not jobs_dir.exists():
        return changed
    for root in sorted(p for p in jobs_dir.iterdir() if p.is_dir()):
        try:
            new = reconcile_job(JobDir(root), launchers)
        except (OSError, ValueError) as e:  # a half-written or foreign directory must not stop the sweep
            logger.warning("reconcile: skipping %s: %s", root, e)
            continue
        if new is not None:
            changed.append(new)
    return changed
