"""Atomic publish of HF-format checkpoints: `step-<N>.tmp/` renamed to `step-<N>/`, then `latest` updated."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from scalarlm.checkpoint.jobdir import JobDir, atomic_write_text
from scalarlm.protocol.training import CheckpointManifest

logger = logging.getLogger(__name__)

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_step(job: JobDir, manifest: CheckpointManifest, write: Callable[[Path], None],
                 keep: int | None = None) -> Path:  # fmt: skip
    """Write a checkpoint with `write(tmp_dir)`, add its manifest, rename it into place, point `latest` at it; then
    with `keep`, remove the steps older than the newest `keep` (`prune_steps`).

    A reader never sees half a checkpoint: until the rename it does not exist under its final name.
    """
    final = job.step_dir(manifest.step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    manifest.created = manifest.created or time.time()
    (tmp / "manifest.json").write_text(manifest.model_dump_json(indent=1))  # unseen until the rename
    for f in tmp.iterdir():
        # A hard link (the base model's tokenizer files) adds no bytes: only its entry, which the folder's fsync
        # makes durable. Measured: 11 fsyncs per LoRA publish before, 6 now (about 2.5 ms each on this disk).
        if f.is_file() and f.stat().st_nlink == 1:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(job.checkpoints_dir)
    atomic_write_text(job.checkpoints_dir / "latest", f"step-{manifest.step}\n")
    if keep is not None:
        prune_steps(job, keep)
    return final


def prune_steps(job: JobDir, keep: int) -> list[int]:
    """Remove the complete steps older than the newest `keep` (train arg `max_checkpoints_to_keep`); return them.
    Each is renamed out of the step names first, so a reader sees it whole or not at all (files a reader has open
    survive the removal)."""
    old = list_steps(job)[:-keep]
    for step in old:
        gone = job.step_dir(step).with_name(f"step-{step}.pruned")
        shutil.rmtree(gone, ignore_errors=True)
        os.replace(job.step_dir(step), gone)
        shutil.rmtree(gone, ignore_errors=True)
    if old:
        logger.info("job %s: removed steps %s (max_checkpoints_to_keep %d)", job.job_id, old, keep)
    return old


def step_folders(folder: Path) -> list[int]:
    """The steps with a renamed `step-N/` folder in `folder` (complete or not), ascending, from one directory read
    (no stat of each)."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    return sorted(int(e.name[5:]) for e in entries
                  if e.name.startswith("step-") and e.name[5:].isdigit() and e.is_dir())  # fmt: skip


def _complete(job: JobDir, step: int) -> bool:
    return (job.step_dir(step) / "manifest.json").exists()


def list_steps(job: JobDir) -> list[int]:
    """Steps with a complete (renamed, manifest-bearing) checkpoint, ascending."""
    return [step for step in step_folders(job.checkpoints_dir) if _complete(job, step)]


def latest_step(job: JobDir) -> int | None:
    """The newest complete step: the one `checkpoints/latest` names, or a newer renamed one (a crash between the
    rename and the pointer's update leaves a complete step the pointer does not name yet). One directory read and
    a manifest check from the newest folder down: the catalog's poll calls this per job, and a job may keep
    hundreds of steps."""
    for step in reversed(step_folders(job.checkpoints_dir)):
        if _complete(job, step):
            return step
    return None


def repair_latest(job: JobDir) -> int | None:
    """Point `checkpoints/latest` at the newest complete step if a crash left it behind; return that step."""
    step = latest_step(job)
    pointer = job.checkpoints_dir / "latest"
    if step is not None and (not pointer.exists() or pointer.read_text().strip() != f"step-{step}"):
        atomic_write_text(pointer, f"step-{step}\n")
    return step


def read_manifest(job: JobDir, step: int) -> CheckpointManifest:
    return CheckpointManifest.model_validate_json((job.step_dir(step) / "manifest.json").read_text())
