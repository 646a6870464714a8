"""The `Launcher` protocol and the launch record a job directory keeps so any control plane can find its process."""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.jobdir import atomic_write_text
from scalarlm.checkpoint.keys import NOTIFY_KEY_FILE, shared_key
from scalarlm.config import ServerSettings, Settings
from scalarlm.protocol.training import TrainJobConfig

RunState = Literal["running", "waiting", "finished", "unknown"]

RECORD_FILE = "launcher.json"
LAUNCHER_LOG = "launcher.log"


class LaunchRecord(BaseModel):
    """`jobs/<id>/launcher.json`: who launched the job and how to find it again after a restart."""

    launcher: Literal["local", "slurm"]
    launcher_id: str
    host: str = Field(default_factory=socket.gethostname)
    pid: int | None = None
    # Process start time in clock ticks since boot (/proc/<pid>/stat field 22): guards against pid reuse.
    start_ticks: int | None = None
    command: list[str] = Field(default_factory=list)
    submitted: float = 0.0
    # The local launcher on a GPU node: the devices (CUDA_VISIBLE_DEVICES entries) the job's ranks were given.
    devices: list[str] | None = None


def write_record(job: JobDir, record: LaunchRecord) -> None:
    """Persist the launch record atomically."""
    atomic_write_text(job.root / RECORD_FILE, record.model_dump_json(indent=1))


def read_record(job: JobDir) -> LaunchRecord | None:
    """The launch record, or None when the job was never handed to a launcher."""
    path = job.root / RECORD_FILE
    if not path.exists():
        return None
    try:
        return LaunchRecord.model_validate(json.loads(path.read_text()))
    except (ValueError, OSError):
        return None


def cancel_requested(job: JobDir) -> bool:
    """True once a user asked to cancel the job."""
    return job.cancel_marker.exists()


def request_cancel(job: JobDir) -> None:
    """Leave the marker the trainer reads on SIGTERM (so it reports CANCELLED, not FAILED)."""
    job.cancel_marker.write_text("cancel requested\n")


def shutdown_requested(job: JobDir) -> bool:
    """True while the job waits to be resumed after the control plane stopped it for its own shutdown."""
    return job.shutdown_marker.exists()


def request_shutdown_stop(job: JobDir) -> None:
    """Leave the marker that makes the trainer save state and end QUEUED (to be resumed on restart)."""
    job.shutdown_marker.write_text("stopped by the control plane's shutdown\n")


def read_logs(job: JobDir, max_bytes: int = 1 << 20) -> str:
    """The launcher's own output followed by each rank's log, each cut to its last `max_bytes`."""
    parts = []
    paths = [job.logs_dir / LAUNCHER_LOG] + sorted(job.logs_dir.glob("rank-*.log")) if job.logs_dir.exists() else []
    for path in paths:
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
        parts.append(f"==> {path.name} <==\n{text}")
    return "\n".join(parts)


@runtime_checkable
class Launcher(Protocol):
    """Starts trainer processes for job directories, reports on them and stops them."""

    name: str

    def submit(self, job: JobDir, config: TrainJobConfig) -> str:
        """Start the trainer on `job`; return the launcher's id for it (pid or SLURM job id)."""
        ...

    def state(self, job: JobDir) -> tuple[RunState, str | None]:
        """Whether the job's processes still run, with a reason when they finished or are unknown."""
        ...

    def cancel(self, job: JobDir) -> None:
        """Stop the job: the trainer saves state and the status ends CANCELLED."""
        ...

    def logs(self, job: JobDir) -> str:
        """The job's output so far."""
        ...

    def stop_for_shutdown(self, jobs: Sequence[JobDir]) -> list[str]:
        """The control plane is shutting down: stop those of `jobs` that would die with it (state saved, status
        QUEUED so a restarted control plane resumes them); return their ids."""
        ...

    def admit(self) -> list[str]:
        """Start the jobs waiting for a free slot that fit now, oldest first; return their ids (called every
        reconcile poll; a launcher whose scheduler queues jobs itself starts none)."""
        ...


def log_path(job: JobDir) -> Path:
    """Where the launcher sends the trainer's stdout and stderr."""
    return job.logs_dir / LAUNCHER_LOG


NOTIFY_ENV = "SCALARLM_NOTIFY_URL"
# The control plane's internal notify key: the trainer's only credential, valid on /v1/internal/published alone.
NOTIFY_KEY_ENV = "SCALARLM_NOTIFY_KEY"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_DEFAULT_API_URL = ServerSettings.model_fields["api_url"].default


def notify_url(settings: Settings, *, remote: bool = False) -> str | None:
    """Where a trainer announces published steps: this server's own listener for a trainer on this machine.

    `server.port` is the port actually bound (`scalarlm serve` binds first and records it, so `--port 0` works).
    A `remote` trainer (SLURM, another node) uses a split-mode control plane's configured `api_url` (the cluster
    address workers use too), else this host's name when listening on every interface. None: no URL is known
    (an app run without `scalarlm serve` on port 0); the catalog's file poll picks the steps up.
    """
    server = settings.server
    if remote and server.role == "api" and server.api_url.rstrip("/") != _DEFAULT_API_URL:
        return server.api_url.rstrip("/")
    if server.port == 0:
        return None
    host = server.host
    if host in _WILDCARD_HOSTS:
        host = socket.gethostname() if remote else "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{server.port}"


def notify_key(home: Path) -> str:
    """The internal notify key in `home/internal/notify.key`: created once, then reused, so trainers launched before
    a restart of the control plane still authenticate."""
    return shared_key(home / NOTIFY_KEY_FILE)
