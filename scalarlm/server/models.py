"""The model catalog: which model names this control plane serves, and the weights version of each.

The base model is version 0. Every training job with a published step is a model named by its job id,
at version = its newest published step; `latest` names the newest such job (by creation). The catalog
learns of new steps from the trainer's notice (POST /v1/internal/published) or, as the fallback, from a
cheap poll that stats each job's `checkpoints/latest`. Workers learn of versions from `versions()`,
which feeds every get_work reply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from scalarlm.server.periodic import every
from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.staging import (
    STAGED_FILE,
    prune_staged,
    remove_deleted_staging,
    remove_empty_staging,
    servable_step,
    staging_root,
)
from scalarlm.config import Settings
from scalarlm.protocol.errors import NotFound
from scalarlm.protocol.generate import ModelVersion
from scalarlm.protocol.training import NAME_PATTERN, CheckpointManifest

logger = logging.getLogger(__name__)

LATEST = "latest"


@dataclass(frozen=True)
class TrainedModel:
    """One trained model's newest published weights."""

    name: str
    version: int
    kind: str
    path: str
    created: float
    loss: float | None = None


def _servable(model: TrainedModel) -> ModelVersion:
    return ModelVersion(name=model.name, version=model.version, kind=model.kind, path=model.path)  # type: ignore[arg-type]


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_size)


class ModelCatalog:
    """The base model (by its served name or its path) and every job with a published step."""

    def __init__(self, settings: Settings) -> None:
        self.base = settings.base_model_name
        self.base_path = settings.model
        aliases = {self.base, settings.model}
        model_path = Path(settings.model)
        if model_path.exists():
            aliases.add(str(model_path.resolve()))
        self._aliases = aliases
        self.jobs_dir = settings.jobs_dir
        self.poll_seconds = settings.training.poll_seconds
        # Where this server's trainers stage full weights (checkpoint/staging.py); the poll removes landed copies.
        self.staging = staging_root(settings.training.staging_dir, settings.home)
        self._trained: dict[str, TrainedModel] = {}
        # (st_mtime_ns, st_size) of each job's `checkpoints/latest` and `checkpoints/staged` when last read: the
        # poll re-reads only changes.
        self._seen: dict[str, tuple[tuple[int, int], ...]] = {}
        self._lock = threading.Lock()  # the poll runs in a thread; routes read from the event loop

    # ---- names ------------------------------------------------------------------------------------

    def resolve(self, name: str | None) -> str:
        """The canonical name for a requested model (None means the base model); NotFound otherwise."""
        if name is None or name in self._aliases:
            return self.base
        if name == LATEST:
            newest = self.newest()
            if newest is None:
                raise NotFound("no trained model has published weights yet, so `latest` names nothing", param="model")
            return newest.name
        with self._lock:
            if name in self._trained:
                return name
        if NAME_PATTERN.match(name) and ".." not in name and self.refresh_job(name) is not None:
            return name  # published before the notice or the poll reached us
        raise NotFound(f"The model `{name}` does not exist.", param="model")

    def version_of(self, name: str) -> int:
        """The current weights version of a canonical model name (0 for the base model)."""
        with self._lock:
            model = self._trained.get(name)
        return model.version if model is not None else 0

    def entry(self, name: str) -> ModelVersion:
        """The servable entry (kind, path, newest version) of a canonical model name, as workers get it."""
        with self._lock:
            model = self._trained.get(name)
        if model is not None:
            return _servable(model)
        if name == self.base:
            return ModelVersion(name=self.base, version=0, kind="base", path=self.base_path)
        raise NotFound(f"The model `{name}` does not exist.", param="model")

    def newest(self) -> TrainedModel | None:
        """The newest (by job creation) trained model with published weights."""
        with self._lock:
            models = list(self._trained.values())
        return max(models, key=lambda m: (m.created, m.name), default=None)

    def trained(self) -> list[TrainedModel]:
        """Every trained model, oldest job first."""
        with self._lock:
            return sorted(self._trained.values(), key=lambda m: (m.created, m.name))

    def versions(self) -> list[ModelVersion]:
        """Every servable model with its newest weights version (workers learn of swaps from this)."""
        return [self.entry(self.base)] + [_servable(m) for m in self.trained()]

    def forget(self, job_id: str) -> None:
        """A job was deleted: its name resolves to nothing from now on (the poll would drop it within a tick)."""
        with self._lock:
            self._trained.pop(job_id, None)
            self._seen.pop(job_id, None)

    # ---- learning of new steps --------------------------------------------------------------------

    def published(self, job_id: str, step: int) -> int:
        """A trainer says `step` of `job_id` is published: re-read the job; return its current version."""
        if not NAME_PATTERN.match(job_id) or ".." in job_id:
            raise NotFound(f"training job {job_id!r} does not exist", param="job_id")
        model = self.refresh_job(job_id)
        if model is None:
            raise NotFound(f"training job {job_id!r} has no published step {step}", param="step")
        return model.version

    def refresh_job(self, job_id: str) -> TrainedModel | None:
        """Re-read one job's newest published step (no-op when `checkpoints/latest` is unchanged)."""
        job = JobDir(self.jobs_dir / job_id)
        stamp = tuple(_stamp(job.checkpoints_dir / name) for name in ("latest", STAGED_FILE))
        if stamp == ((0, 0), (0, 0)):
            return None
        with self._lock:
            if self._seen.get(job_id) == stamp and job_id in self._trained:
                return self._trained[job_id]
        try:
            model = self._read(job)
        except (OSError, ValueError) as e:
            logger.warning("catalog: cannot read %s: %s", job.root, e)
            return None
        with self._lock:
            if model is None:
                self._trained.pop(job_id, None)
                self._seen.pop(job_id, None)
                return None
            old = self._trained.get(job_id)
            if old is None or old.version != model.version:
                logger.info("model %s: version %d (%s)", job_id, model.version, model.kind)
            self._trained[job_id] = model
            self._seen[job_id] = stamp
        return model

    def _read(self, job: JobDir) -> TrainedModel | None:
        servable = servable_step(job)  # a staged full-weight step before its durable copy lands
        if servable is None:
            return None
        step, path = servable
        manifest = CheckpointManifest.model_validate_json((path / "manifest.json").read_text())
        created = job.config_path.stat().st_mtime if job.config_path.exists() else manifest.created
        try:
            created = job.read_config().created or created
        except (OSError, ValueError):
            pass
        return TrainedModel(
            name=job.job_id, version=step, kind=manifest.kind, path=str(path),
            created=created, loss=manifest.loss,
        )  # fmt: skip

    def refresh(self) -> None:
        """Poll every job directory (stats `checkpoints/latest`; reads only the changed ones); drop deleted jobs and
        their staged copies."""
        entries = list(self.jobs_dir.iterdir()) if self.jobs_dir.is_dir() else None
        roots = [p.name for p in entries or [] if p.is_dir()]
        for job_id in roots:
            self.refresh_job(job_id)
        if entries is not None:  # (a jobs directory that did not list removes no staged copy)
            self._prune_staging(entries)
        present = set(roots)
        with self._lock:
            for gone in [name for name in self._trained if name not in present]:
                del self._trained[gone]
                self._seen.pop(gone, None)

    @asynccontextmanager
    async def staging_cleared(self) -> AsyncIterator[None]:
        """On exit (after the engine and the trainers stopped), remove every staged copy whose durable copy landed,
        and those of deleted jobs."""
        try:
            yield
        finally:
            if self.staging is not None and self.jobs_dir.exists():
                self._prune_staging(list(self.jobs_dir.iterdir()), now=float("inf"))
                remove_empty_staging(self.staging)

    def _prune_staging(self, entries: list[Path], now: float | None = None) -> None:
        """Remove the staged copies the jobs in `entries` (a listing of the jobs directory) no longer need
        (`prune_staged`, at time `now`) and those of jobs not in it (deleted)."""
        if self.staging is None:
            return
        for root in entries:
            if root.is_dir():
                prune_staged(JobDir(root), self.staging, now=now)
        remove_deleted_staging(self.staging, {p.name for p in entries})

    def polling(self) -> AbstractAsyncContextManager[None]:
        """Refresh now and then every `training.poll_seconds` (the fallback when a notice is lost)."""
        return every(self.poll_seconds, self.refresh, "catalog poll")
