"""Helpers of the closed-loop tests: publish checkpoints by hand, as a trainer would."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from scalarlm.checkpoint import JobDir, publish_step
from scalarlm.config import Settings
from scalarlm.protocol.training import CheckpointManifest, JobStatus, TrainArgs, TrainJobConfig


def hand_published_job(settings: Settings, job_id: str, steps: list[int], source: Path, kind: str = "full") -> JobDir:
    """A finished job directory whose steps were published by hand (files copied from `source`)."""
    job = JobDir.under(settings.jobs_dir, job_id)
    job.create()
    job.write_config(TrainJobConfig(job_id=job_id, base_model=str(source), train_args=TrainArgs(adapter_type=kind),
                                    created=time.time()))  # fmt: skip
    job.write_status(JobStatus(job_id=job_id, status="RUNNING", step=0, max_steps=10))
    for step in steps:
        publish(job, step, source, kind)
    return job


def publish(job: JobDir, step: int, source: Path, kind: str = "full", loss: float = 1.5) -> Path:
    """Publish `step` of `job` with `checkpoint.publish_step`, copying the model files of `source`."""

    def write(tmp: Path) -> None:
        for f in source.iterdir():
            if f.is_file():
                shutil.copy(f, tmp / f.name)

    manifest = CheckpointManifest(job_id=job.job_id, step=step, base_model=str(source), kind=kind, loss=loss)
    return publish_step(job, manifest, write)
