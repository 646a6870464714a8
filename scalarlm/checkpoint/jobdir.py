"""Paths and small atomic file operations of one job directory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from scalarlm.protocol.training import JobStatus, TrainJobConfig, check_name


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` so a reader sees the old file or the new one, never half of it."""
    # A unique temp name per call: two writers (threads or processes) never share one.
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    os.fchmod(fd, 0o644)  # readable by every role sharing the volume, like a plainly created file
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def link_or_copy(source: str | Path, dest: str | Path) -> None:
    """Hard-link `source` at `dest` (a symlink's target: a hub cache snapshot's files link into its blobs), else copy
    it (another filesystem, or links not allowed there). For files never written in place."""
    try:
        os.link(Path(source).resolve(), dest)
    except OSError:
        shutil.copy2(source, dest)


# Markers the control plane leaves for the trainer (rank 0 checks them every step): stop, save state, and end
# CANCELLED (a user cancel) or QUEUED to be resumed (the control plane shutting down).
CANCEL_FILE = "cancel.requested"
SHUTDOWN_FILE = "shutdown.requested"


class JobDir:
    """`$SCALARLM_HOME/jobs/<job_id>/` and what lives in it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @classmethod
    def under(cls, jobs_dir: Path, job_id: str) -> "JobDir":
        """The directory of `job_id`; the id is checked so no path escapes `jobs_dir`."""
        return cls(Path(jobs_dir) / check_name(job_id, "job id"))

    @property
    def job_id(self) -> str:
        return self.root.name

    @property
    def config_path(self) -> Path:
        return self.root / "job.yaml"

    @property
    def dataset_path(self) -> Path:
        return self.root / "dataset.jsonl"

    @property
    def status_path(self) -> Path:
        return self.root / "status.json"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def cancel_marker(self) -> Path:
        return self.root / CANCEL_FILE

    @property
    def shutdown_marker(self) -> Path:
        return self.root / SHUTDOWN_FILE

    def step_dir(self, step: int) -> Path:
        return self.checkpoints_dir / f"step-{step}"

    @property
    def base_dir(self) -> Path:
        """Where a job keeps its own links to a base that is another job's published step (`own_base`)."""
        return self.root / "base"

    def own_base(self, step_dir: Path) -> Path:
        """Hard-link another job's published step into `base/` and return it: that job may prune (train arg
        `max_checkpoints_to_keep`) or be deleted while this one still reads its base at each publish and on resume.
        Links cost no space (jobs share one volume); a file that cannot be linked is copied."""
        shutil.copytree(step_dir, self.base_dir, copy_function=link_or_copy)
        return self.base_dir

    def rank_log(self, rank: int) -> Path:
        return self.logs_dir / f"rank-{rank}.log"

    def create(self) -> None:
        for d in (self.root, self.logs_dir, self.checkpoints_dir, self.state_dir):
            d.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: TrainJobConfig) -> None:
        atomic_write_text(self.config_path, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))

    def read_config(self) -> TrainJobConfig:
        return TrainJobConfig.model_validate(yaml.safe_load(self.config_path.read_text()))

    def write_status(self, status: JobStatus) -> None:
        status.updated = time.time()
        atomic_write_text(self.status_path, status.model_dump_json(indent=1))

    def read_status(self) -> JobStatus:
        return JobStatus.model_validate_json(self.status_path.read_text())

    def update_status(self, **changes: Any) -> JobStatus:
        """Read, change and atomically rewrite status.json (single writer per field by convention)."""
        status = self.read_status() if self.status_path.exists() else JobStatus(job_id=self.job_id)
        status = status.model_copy(update=changes)
        self.write_status(status)
        return status

    def append_metrics(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every complete metrics line (a line being written is skipped)."""
        if not self.metrics_path.exists():
            return []
        rows = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows
