"""What the SDK's RestClient reads: training runs, their checkpoints, and the weights info of a tinker path.

A training run is a session job made through `create_model` (or from saved state): it has `tinker/run.json`.
Its checkpoints are its saved states (`weights/<name>`, type "training") and its named samplers
(`sampler_weights/<name>`, type "sampler"), read from the files of `checkpoint/tinker.py`, so listings survive a
restart of the control plane. Every run of this server is listed to every key with the `train` scope (as every
Tinker route lets such a key use any run); `access_scope` and `project_id` are accepted and change nothing.
"""

from __future__ import annotations

import shutil
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.tinker import TinkerRunDir
from scalarlm.protocol.errors import InvalidRequest, NotFound

if TYPE_CHECKING:
    from scalarlm.server.routers.tinker.service import TinkerService

CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def _strings(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    """User metadata as the SDK types it (str -> str)."""
    return {str(k): str(v) for k, v in metadata.items()} if metadata else None


def _checkpoint(run_id: str, entry: dict[str, Any]) -> dict[str, Any]:
    kind, name = entry["kind"], entry["name"]
    return {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": CHECKPOINT_TYPES[kind], "time": _iso(entry["time"]),
            "tinker_path": f"tinker://{run_id}/{kind}/{name}", "size_bytes": entry["size_bytes"], "public": False,
            "user_metadata": _strings(entry["user_metadata"])}  # fmt: skip


def _visible(run: dict[str, Any], viewer: str | None) -> bool:
    """Whether the caller may see a run: its own key's runs (`viewer` None: an admin key or auth off sees all)."""
    return viewer is None or run.get("owner", "local") == viewer


def _run_jobs(tinker: "TinkerService", viewer: str | None) -> list[JobDir]:
    """The training runs the caller may see, newest first."""
    runs = [TinkerRunDir(JobDir(p.parent.parent)) for p in tinker.jobs_dir.glob("*/tinker/run.json")]
    runs = [r for r in runs if _visible(r.read_run(), viewer)]
    runs.sort(key=lambda r: r.read_run().get("created", 0.0), reverse=True)
    return [r.job for r in runs]


def _run_job(tinker: "TinkerService", run_id: str, viewer: str | None) -> JobDir:
    job = tinker.sessions.jobs.job(tinker.job_id(run_id))
    files = TinkerRunDir(job)
    if not files.is_run():
        raise NotFound(f"{run_id!r} is not a Tinker training run (it was not made through create_model)",
                       param="training_run_id")  # fmt: skip
    if not _visible(files.read_run(), viewer):  # another key's run: as if it did not exist
        raise NotFound(f"training run {run_id!r} does not exist", param="training_run_id")
    return job


def check_owner(tinker: "TinkerService", model_id: Any, viewer: str | None) -> None:
    """A training route's model id (or a tinker path's run) must be the caller's: another key's run answers NotFound,
    as in the listings (an admin key or a server without keys reaches every run)."""
    if viewer is None:
        return
    run = tinker.parse_path(model_id, "path").run if str(model_id).startswith("tinker://") else model_id
    try:
        _run_job(tinker, run, viewer)
    except NotFound as e:
        raise NotFound(f"no training client {model_id!r} on this server", param="model_id") from e


def training_run(tinker: "TinkerService", job: JobDir) -> dict[str, Any]:
    """The SDK's TrainingRun of one run."""
    files = TinkerRunDir(job)
    run, args = files.read_run(), job.read_config().train_args
    lora = args.adapter_type == "lora"
    checkpoints = [_checkpoint(job.job_id, c) for c in files.checkpoints()]
    last = {kind: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind), None)
            for kind in ("training", "sampler")}  # fmt: skip
    session = job.root / "session"
    last_request = max(run.get("created", 0.0), session.stat().st_mtime if session.exists() else 0.0)
    return {"training_run_id": job.job_id, "base_model": tinker.catalog.base, "model_owner": run.get("owner", "local"),
            "is_lora": lora, "corrupted": False, "lora_rank": args.lora_config.r if lora else None,
            "last_request_time": _iso(last_request), "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"], "user_metadata": _strings(run.get("user_metadata"))}  # fmt: skip


def get_training_run(tinker: "TinkerService", run_id: str, viewer: str | None) -> dict[str, Any]:
    return training_run(tinker, _run_job(tinker, run_id, viewer))


def _page(limit: int, offset: int) -> tuple[int, int]:
    if limit < 0 or offset < 0:
        raise InvalidRequest("limit and offset must not be negative", param="limit" if limit < 0 else "offset")
    return limit, offset


def list_training_runs(tinker: "TinkerService", limit: int, offset: int, viewer: str | None) -> dict[str, Any]:
    """The caller's training runs, newest first, one page (limit 0: all)."""
    limit, offset = _page(limit, offset)
    jobs = _run_jobs(tinker, viewer)
    page = jobs[offset : offset + limit] if limit else jobs[offset:]
    return {"training_runs": [training_run(tinker, j) for j in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(jobs)}}  # fmt: skip


def list_checkpoints(tinker: "TinkerService", run_id: str, viewer: str | None) -> dict[str, Any]:
    """One run's saved states and named samplers, oldest first (unpaginated, as the SDK expects)."""
    job = _run_job(tinker, run_id, viewer)
    return {"checkpoints": [_checkpoint(job.job_id, c) for c in TinkerRunDir(job).checkpoints()]}


def list_user_checkpoints(tinker: "TinkerService", limit: int, offset: int, viewer: str | None) -> dict[str, Any]:
    """The checkpoints of every run the caller may see, newest first, one page (limit 0: all)."""
    limit, offset = _page(limit, offset)
    found = [_checkpoint(j.job_id, c) | {"training_run_id": j.job_id}
             for j in _run_jobs(tinker, viewer) for c in TinkerRunDir(j).checkpoints()]  # fmt: skip
    found.sort(key=lambda c: c["time"], reverse=True)
    page = found[offset : offset + limit] if limit else found[offset:]
    for c in page:
        c.pop("training_run_id")
    return {"checkpoints": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}


def weights_info(tinker: "TinkerService", tinker_path: Any, viewer: str | None) -> dict[str, Any]:
    """What loading a tinker path needs: base model and the LoRA shape (rank, which layers it trains)."""
    path = tinker.parse_path(tinker_path, "tinker_path")
    job = _run_job(tinker, path.run, viewer)
    files = TinkerRunDir(job)
    exists = files.weights_dir(path.name).exists() if path.kind == "weights" else files.read_sampler(path.name)
    if not exists:
        raise NotFound(f"no checkpoint at {tinker_path!r}", param="tinker_path")
    lora = files.read_run().get("lora")
    args = job.read_config().train_args
    if args.adapter_type != "lora" or not lora:
        return {"base_model": tinker.catalog.base, "is_lora": False}
    return {"base_model": tinker.catalog.base, "is_lora": True, "lora_rank": args.lora_config.r,
            "train_mlp": bool(lora.get("train_mlp", True)), "train_attn": bool(lora.get("train_attn", True)),
            "train_unembed": False}  # fmt: skip


def delete_checkpoint(tinker: "TinkerService", run_id: str, checkpoint_id: str, viewer: str | None) -> None:
    """Remove a saved state or a sampler's name (the published `checkpoints/step-<N>` it named stays servable)."""
    job = _run_job(tinker, run_id, viewer)
    path = tinker.parse_path(f"tinker://{job.job_id}/{checkpoint_id}", "checkpoint_id")
    files = TinkerRunDir(job)
    if path.kind == "weights" and files.weights_dir(path.name).exists():
        shutil.rmtree(files.weights_dir(path.name))
    elif path.kind == "sampler_weights" and files.sampler_path(path.name).exists():
        files.sampler_path(path.name).unlink()
        tinker.named.pop(str(path), None)
    else:
        raise NotFound(f"training run {run_id!r} has no checkpoint {checkpoint_id!r}", param="checkpoint_id")
