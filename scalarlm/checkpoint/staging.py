"""Full-weight publish that does not wait for the durable write: stage in memory, serve it, then land it.

When the trainer and the engine share a host, the trainer writes step N into `<staging root>/<job id>/step-N/`
(memory-backed: `training.staging_dir`, /dev/shm by default), points `checkpoints/staged` at it and announces it;
the catalog serves a complete staged step that is newer than the durable `latest`. A background thread (at the lowest
CPU priority, so it does not slow the engine swapping that step in or the next step) then lands
the same files as `checkpoints/step-N/` with `publish_step` (temp dir, fsync, rename, `latest`) while training goes
on, and announces again, so the catalog moves to the durable copy: that is what a restart or another host reads.
Landings queue, one at a time in step order, so a step whose predecessor is still landing does not wait for it (on a
GPU a large model's durable write can outlast an RL step); the trainer waits only when the staging directory runs out
of room, or at a resume save, which needs its step durable. A step published only to serve the newest weights (a
session step, a job's `steps_per_publish` step, not a `steps_per_checkpoint` one) is `supersedable`: if a newer step
is staged before its landing starts, it is left out and the newer one lands, so a disk slower than the steps keeps a
queue of at most one waiting step instead of one that grows by a step per step, and the staged copies in memory are
those of the steps published during one landing (the left-out ones are pruned once a newer step has landed).
A staged supersedable step carries a `supersedable` marker file (never landed), so the reconcile after a dead trainer
(`land_orphaned`) leaves out the same steps the trainer would have.
A kill during the landing leaves the previous durable step and a `step-N.tmp/` the next publish replaces, never a
torn `step-N/`. The control plane removes staged copies once their durable copy has landed (`prune_staged`), and
those of a deleted job (`remove_deleted_staging`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from scalarlm.checkpoint.jobdir import JobDir, atomic_write_text
from scalarlm.checkpoint.publish import latest_step, publish_step, step_folders
from scalarlm.protocol.training import CheckpointManifest

logger = logging.getLogger(__name__)

STAGING_ENV = "SCALARLM_STAGING_DIR"  # the launcher tells a trainer on the serving host where to stage
STAGED_FILE = "staged"  # in `checkpoints/`: "step-<N> <absolute staged path>"
SUPERSEDABLE_FILE = "supersedable"  # in a staged step: a newer staged step lands instead of it (never landed itself)
# A staged copy whose durable copy landed is removed once a newer step is staged or after this long (a worker
# that began reading it before the landing has that long to finish; files it has open survive the removal).
STAGED_GRACE_SECONDS = 30.0
STAGING_HEADROOM_BYTES = 256 << 20  # left free in the staging directory beyond two copies of a checkpoint
# The landing thread's nice value. It copies bytes the engine is reading at that moment (the swap of the step it just
# staged) on the cores the engine and the next step use; at nice 0 the swap of a 155 MB step took 0.28-0.58 s on 2
# cores, at 19 it took 0.08-0.16 s, as a swap with no landing beside it does. It still gets the idle cores.
LANDING_NICE = 19


def staging_root(staging_dir: str, home: Path) -> Path | None:
    """This control plane's staging root under `staging_dir` (one per home: two servers on a host never share
    one); None when staging is off ("") or the directory does not exist."""
    if not staging_dir or not Path(staging_dir).is_dir():
        return None
    tag = hashlib.sha256(str(Path(home).resolve()).encode()).hexdigest()[:12]
    return Path(staging_dir) / f"scalarlm-staging-{tag}"


def _pointer(job: JobDir) -> Path:
    return job.checkpoints_dir / STAGED_FILE


def staged_step(job: JobDir) -> tuple[int, Path] | None:
    """The staged step `checkpoints/staged` names, if its copy is complete (renamed, with its manifest)."""
    try:
        name, path = _pointer(job).read_text().split(maxsplit=1)
    except (OSError, ValueError):
        return None
    staged = Path(path.strip())
    if not name.startswith("step-") or not name[5:].isdigit() or not (staged / "manifest.json").exists():
        return None
    return int(name[5:]), staged


def servable_step(job: JobDir) -> tuple[int, Path] | None:
    """The newest complete step to serve and where its files are: the staged copy while it is newer than the
    durable `latest`, else the durable copy."""
    durable = latest_step(job)
    staged = staged_step(job)
    if staged is not None and (durable is None or staged[0] > durable):
        return staged
    return (durable, job.step_dir(durable)) if durable is not None else None


def stage_step(job: JobDir, root: Path, manifest: CheckpointManifest, write: Callable[[Path], None],
               supersedable: bool = False) -> Path:  # fmt: skip
    """Write step N with `write(tmp)` into `root/<job>/step-N/` (renamed into place, no fsync: it is memory) and
    point `checkpoints/staged` at it; return its path. `supersedable` marks it (SUPERSEDABLE_FILE)."""
    final = root / job.job_id / f"step-{manifest.step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if supersedable:
        (tmp / SUPERSEDABLE_FILE).touch()
    manifest.created = manifest.created or time.time()
    (tmp / "manifest.json").write_text(manifest.model_dump_json(indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    job.checkpoints_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(_pointer(job), f"step-{manifest.step} {final}\n")
    return final


def land_staged(job: JobDir, staged: Path, manifest: CheckpointManifest, keep: int | None = None) -> Path:
    """Copy a staged step into `checkpoints/step-N/` durably and atomically (`publish_step`, which keeps the newest
    `keep` steps)."""

    def copy(dest: Path) -> None:
        for f in staged.iterdir():
            if f.is_file() and f.name not in ("manifest.json", SUPERSEDABLE_FILE):
                shutil.copyfile(f, dest / f.name)

    return publish_step(job, manifest, copy, keep)


def land_orphaned(job: JobDir) -> list[int]:
    """Once the trainer is gone: land, in step order, the complete staged steps newer than the durable `latest`
    whose landing it did not finish (it crashed with landings queued), so the version being served stays and a
    restart or another worker can read it; return those steps. As the trainer's queue would, it leaves out a
    supersedable step that a newer staged step overtook (the newest always lands)."""
    staged = staged_step(job)
    if staged is None:
        return []
    durable = latest_step(job) or 0
    folder = staged[1].parent  # this job's staging folder: every staged step lies beside the newest
    try:
        keep = job.read_config().train_args.max_checkpoints_to_keep
    except (OSError, ValueError):  # no readable config: keep every step
        keep = None
    landed = []
    for step in step_folders(folder):
        path = folder / f"step-{step}"
        overtaken = step < staged[0] and (path / SUPERSEDABLE_FILE).exists()
        if durable < step <= staged[0] and (path / "manifest.json").exists() and not overtaken:
            land_staged(job, path, CheckpointManifest.model_validate_json((path / "manifest.json").read_text()),
                        keep)  # fmt: skip
            landed.append(step)
    return landed


def prune_staged(job: JobDir, root: Path, now: float | None = None) -> list[int]:
    """Remove this job's staged copies whose durable copy has landed, once a newer step is staged or
    STAGED_GRACE_SECONDS after the landing; return the steps removed."""
    folder = root / job.job_id
    durable = latest_step(job)
    if durable is None or not folder.is_dir():
        return []
    now = time.time() if now is None else now
    steps = step_folders(folder)
    removed = []
    for step in steps:
        if step > durable:
            continue
        try:
            landed = (job.step_dir(step) / "manifest.json").stat().st_mtime
        except OSError:
            landed = (job.checkpoints_dir / "latest").stat().st_mtime  # superseded before it landed
        if step < steps[-1] or now - landed >= STAGED_GRACE_SECONDS:
            shutil.rmtree(folder / f"step-{step}", ignore_errors=True)
            removed.append(step)
    return removed  # the folder and the pointer stay: the trainer may be staging its next step right now


def remove_deleted_staging(root: Path, jobs: Collection[str]) -> list[str]:
    """Remove the staged copies under `root` of every job not in `jobs` (the job directories a listing just found: a
    job deleted while a copy was staged): nothing serves or lands them any more, and on a memory filesystem each
    would hold its checkpoint's size in memory until the host restarts. Return the job ids removed."""
    if not root.is_dir():
        return []
    removed = []
    for folder in sorted(root.iterdir()):
        if folder.is_dir() and folder.name not in jobs:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def remove_empty_staging(root: Path) -> None:
    """Remove the job folders left empty under `root`, then `root` if empty (rmdir: a folder a trainer is staging
    into right now is not empty, so it stays)."""
    if not root.is_dir():
        return
    for folder in [*root.iterdir(), root]:
        try:
            folder.rmdir()
        except OSError:
            pass


def _run_in_background() -> None:
    """Lower the calling thread's CPU priority to LANDING_NICE (Linux: a thread's nice value is its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LANDING_NICE)
    except OSError as e:  # e.g. a sandbox that refuses it: land at normal priority
        logger.debug("could not lower the landing thread's priority: %s", e)


def _room(root: Path) -> int:
    """Free bytes where `root` is (or would be created)."""
    folder = root
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


@dataclass(eq=False)
class _Landing:
    staged: Path
    manifest: CheckpointManifest
    supersedable: bool


class StagedPublisher:
    """Rank 0's publisher of full weights: `publish` stages and returns; a thread lands the staged steps durably, one
    at a time in step order, calling `on_landed(step)` after each, and leaves out a `supersedable` step that a newer
    staged step has overtaken before its landing began. `wait` blocks until every queued landing is done and raises
    what one raised (then nothing after it lands: `latest` never skips a step it was asked to keep).

    A step is staged only while the staging directory has room for two copies of `expected_bytes` (the base
    checkpoint's size; a container's /dev/shm is often 64 MiB, and vLLM needs some of it). Without room the queued
    landings finish first (the control plane then removes their staged copies); if there is still none, or writing
    there fails, the step is published durably at once, as without staging."""

    def __init__(self, job: JobDir, root: Path, on_landed: Callable[[int], object], expected_bytes: int = 0,
                 keep: int | None = None) -> None:  # fmt: skip
        self.job, self.root, self.on_landed = job, root, on_landed
        self.expected_bytes = expected_bytes
        self.keep = keep  # each landing keeps the newest `keep` durable steps (publish_step)
        self._lock = threading.Lock()
        self._queue: deque[_Landing] = deque()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def publish(self, job: JobDir, manifest: CheckpointManifest, write: Callable[[Path], None],
                supersedable: bool = False) -> Path:  # fmt: skip
        """`publish_step`'s signature: stage step N now and queue its landing (or publish it durably); with
        `supersedable`, a newer step staged before this one's landing begins lands instead of it."""
        self._raise_error()
        if not self._has_room():
            self.wait()
            if not self._has_room():
                logger.warning("staging %s has too little room for a %.0f MiB checkpoint: publishing step %d durably",
                               self.root, self.expected_bytes / 2**20, manifest.step)
                return publish_step(job, manifest, write, self.keep)
        try:
            staged = stage_step(job, self.root, manifest, write, supersedable)
        except OSError as e:  # e.g. the memory filesystem filled up
            logger.warning("could not stage step %d in %s (%s): publishing it durably", manifest.step, self.root, e)
            shutil.rmtree(self.root / job.job_id / f"step-{manifest.step}.tmp", ignore_errors=True)
            self.wait()  # `latest` moves forward only: the queued steps land first
            return publish_step(job, manifest, write, self.keep)
        with self._lock:
            self._queue.append(_Landing(staged, manifest.model_copy(), supersedable))
            if len(self._queue) > 1:
                logger.info("step %d staged; %d landings queued", manifest.step, len(self._queue))
            if self._thread is None:
                self._thread = threading.Thread(target=self._land_queued, name="land-checkpoint", daemon=True)
                self._thread.start()
        return staged

    def _has_room(self) -> bool:
        return _room(self.root) >= 2 * self.expected_bytes + STAGING_HEADROOM_BYTES

    def _land_queued(self) -> None:
        _run_in_background()
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                self._leave_out_superseded()
                landing = self._queue[0]
            manifest = landing.manifest
            started = time.monotonic()
            try:
                land_staged(self.job, landing.staged, manifest, self.keep)
            except BaseException as e:  # re-raised in the training thread; the later steps stay staged, unlanded
                with self._lock:
                    self._error = e
                    self._queue.clear()
                    self._thread = None
                return
            with self._lock:
                self._queue.popleft()
            logger.info("landed step %d durably in %.2f s", manifest.step, time.monotonic() - started)
            self.on_landed(manifest.step)

    def _leave_out_superseded(self) -> None:
        """Drop every queued supersedable step but the newest queued one (the lock held). Its staged copy stays until
        the control plane prunes it (`prune_staged`: a step at or below the durable `latest` with a newer one staged);
        a worker reading it then has the files it opened."""
        newest = self._queue[-1]
        left_out = [landing for landing in self._queue if landing.supersedable and landing is not newest]
        if left_out:
            self._queue = deque(landing for landing in self._queue if landing not in left_out)
            logger.info("steps %s superseded before they landed: landing step %d next",
                        [landing.manifest.step for landing in left_out], self._queue[0].manifest.step)  # fmt: skip

    def wait(self) -> None:
        """Block until every queued landing is done; raise the error of one that failed."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        self._raise_error()

    def _raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the durable copy of a staged checkpoint could not be written: {error}") from error
