"""Training from the client: `train()` uploads a dataset the way ScalarLM's SDK does and returns a job handle.

The archive is a tar.gz holding `dataset.jsonlines` (no code is ever sent). Archives up to
`SINGLE_POST_THRESHOLD` go in one multipart POST; larger ones through the chunked upload routes.
`TrainingJob` / `AsyncTrainingJob` follow a job: `status()`, `wait()` with a progress bar,
`metrics()`, `cancel()`, `resume()`; `plot()` writes a PNG loss curve.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from scalarlm.client.flows import AsyncRun, Call, Flow, Run, Sleep
from scalarlm.protocol.errors import ChecksumMismatch, ScalarLMError
from scalarlm.protocol.training import JobStatus, TrainingJobResponse, TrainResponse

# The ScalarLM SDK's defaults: one POST up to 90 MB (under common proxy caps), then 50 MB chunks.
SINGLE_POST_THRESHOLD = 90 * 1024 * 1024
CHUNK_SIZE = 50 * 1024 * 1024
CHUNK_RETRIES = 5
DEFAULT_POLL_SECONDS = 1.0

Dataset = str | Path | Iterable[Mapping[str, Any]]


class TrainingFailed(ScalarLMError):
    """The training job ended FAILED; `reason` says why (as the server recorded it)."""

    status_code = 500
    error_type = "training_failed"

    def __init__(self, job_id: str, reason: str | None):
        super().__init__(f"training job {job_id} failed: {reason or 'no reason recorded'}")
        self.job_id = job_id
        self.reason = reason


def dataset_bytes(data: Dataset) -> bytes:
    """JSONL bytes from a list of row dicts or a path to a JSONL file."""
    if isinstance(data, (str, Path)):
        raw = Path(data).read_bytes()
    else:
        raw = "".join(json.dumps(dict(row)) + "\n" for row in data).encode()
    if not raw.strip():
        raise ValueError("the dataset is empty: give at least one row")
    return raw


def training_archive(data: Dataset) -> bytes:
    """The tar.gz the server expects (ScalarLM's layout): one member, `dataset.jsonlines`."""
    raw = dataset_bytes(data)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("dataset.jsonlines")
        info.size, info.mode = len(raw), 0o644
        tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def _params(model_name: str | None, train_args: Mapping[str, Any] | None) -> dict[str, Any]:
    params = dict(train_args or {})
    if model_name is not None:
        params["llm_name"] = model_name  # as the ScalarLM SDK does
    return params


def submit_flow(archive: bytes, params: dict[str, Any], threshold: int, chunk_size: int) -> Flow:
    """Upload the archive (one POST, or init/chunks/finalize) and return the server's TrainResponse."""
    if len(archive) <= threshold:
        files = {
            "file": ("dataset", archive, "application/octet-stream"),
            "params": (None, json.dumps(params).encode(), "application/json"),
        }
        body = yield Call("POST", "/v1/megatron/train", files=files)  # type: ignore[arg-type]
        return TrainResponse.model_validate(body)
    chunks = [archive[i : i + chunk_size] for i in range(0, len(archive), chunk_size)]
    init = yield Call("POST", "/v1/megatron/upload/init", json={
        "total_size": len(archive), "total_hash": hashlib.sha256(archive).hexdigest(), "chunk_size": chunk_size,
        "num_chunks": len(chunks), "compressed": True, "params": params,
    })  # fmt: skip
    upload_id, have = init["upload_id"], set(init.get("received_chunks", []))
    for index, chunk in enumerate(chunks):
        if index not in have:
            yield from _send_chunk(upload_id, index, chunk)
    body = yield Call("POST", "/v1/megatron/upload/finalize", json={"upload_id": upload_id})
    return TrainResponse.model_validate(body)


def _send_chunk(upload_id: str, index: int, chunk: bytes) -> Flow:
    headers = {
        "X-Upload-Id": upload_id, "X-Chunk-Index": str(index),
        "X-Chunk-Hash": hashlib.sha256(chunk).hexdigest(), "Content-Type": "application/octet-stream",
    }  # fmt: skip
    for attempt in range(CHUNK_RETRIES):
        try:
            return (yield Call("POST", "/v1/megatron/upload/chunk", content=chunk, headers=headers))
        except ChecksumMismatch:  # corrupted in transit: send it again
            if attempt == CHUNK_RETRIES - 1:
                raise
            yield Sleep(min(2.0**attempt, 30.0))
    return None


def train_flow(data: Dataset, model_name: str | None, train_args: Mapping[str, Any] | None, threshold: int,
               chunk_size: int) -> Flow:  # fmt: skip
    """Upload the dataset and train args; return (job id, TrainResponse) for the job handle."""
    response = yield from submit_flow(training_archive(data), _params(model_name, train_args), threshold, chunk_size)
    return response.job_status["job_id"], response


def job_flow(job_id: str) -> Flow:
    """(job id, its description) for a handle on an existing job (NotFound for unknown ids)."""
    return job_id, (yield from describe_flow(job_id))


def describe_flow(job_id: str) -> Flow:
    body = yield Call("GET", f"/v1/megatron/train/{job_id}")
    return TrainingJobResponse.model_validate(body)


def status_flow(job_id: str) -> Flow:
    info = yield from describe_flow(job_id)
    return JobStatus.model_validate(info.job_status)


def metrics_flow(job_id: str) -> Flow:
    return (yield Call("GET", f"/v1/megatron/train/{job_id}/metrics"))


def cancel_flow(job_id: str) -> Flow:
    body = yield Call("POST", f"/v1/megatron/cancel/{job_id}")
    return JobStatus.model_validate(body)


def resume_flow(job_id: str) -> Flow:
    body = yield Call("POST", f"/v1/megatron/resume/{job_id}")
    return JobStatus.model_validate(body)


def delete_flow(job_id: str) -> Flow:
    return (yield Call("POST", f"/v1/megatron/delete/{job_id}"))


def wait_flow(job_id: str, timeout: float | None, poll_seconds: float, progress: bool | None) -> Flow:
    """Poll until the job ends; a tqdm bar follows the steps. Raise TrainingFailed on FAILED."""
    deadline = None if timeout is None else time.monotonic() + timeout
    show = sys.stderr.isatty() if progress is None else progress
    status = yield from status_flow(job_id)
    bar = tqdm(total=status.max_steps or None, disable=not show, desc=job_id, unit="step")
    try:
        while True:
            if status.step > bar.n:
                bar.update(status.step - bar.n)
            if status.loss is not None:
                bar.set_postfix(loss=f"{status.loss:.4f}", refresh=False)
            if status.terminal:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"training job {job_id} is still {status.status} after {timeout} s")
            yield Sleep(poll_seconds)
            status = yield from status_flow(job_id)
    finally:
        bar.close()
    if status.status == "FAILED":
        raise TrainingFailed(job_id, status.reason)
    return status


def logs_flow(job_id: str) -> Flow:
    """The launcher's output and each rank's log, as one text."""
    return (yield Call("GET", f"/v1/megatron/train/{job_id}/logs"))


def checkpoints_flow(job_id: str) -> Flow:
    """Every published checkpoint of a job: step (= version), kind, bytes, files."""
    return (yield Call("GET", f"/v1/megatron/train/{job_id}/checkpoints"))


def dataset_flow(job_id: str, limit: int) -> Flow:
    """How many rows a job trains on, and the first `limit`."""
    return (yield Call("GET", f"/v1/megatron/train/{job_id}/dataset?limit={limit}"))


def get_flow(path: str) -> Flow:
    return (yield Call("GET", path))


def plot_metrics(metrics: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Write a PNG loss curve (step vs loss) with matplotlib's Agg canvas (no global pyplot state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plot() needs matplotlib: pip install matplotlib") from e

    points = [(row["step"], row["loss"]) for row in metrics if row.get("loss") is not None and "step" in row]
    if not points:
        raise ValueError(f"{title} has no loss values to plot yet")
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([s for s, _ in points], [loss for _, loss in points], marker="." if len(points) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _job_id(job: "str | TrainingJob | AsyncTrainingJob") -> str:
    return job if isinstance(job, str) else job.id


def _title(job_id: str) -> str:
    return f"training loss: {job_id}"


class TrainingJob:
    """A handle on one training job; `job["job_status"]` reads the answer that created it (ScalarLM style)."""

    def __init__(self, run: Run, job_id: str, response: TrainResponse | None = None) -> None:
        self._run = run
        self.id = job_id
        self.response = response

    def __getitem__(self, key: str) -> Any:
        if self.response is None:
            self.response = self.info()
        return self.response.model_dump()[key]

    def __repr__(self) -> str:
        return f"TrainingJob({self.id!r})"

    def info(self) -> TrainingJobResponse:
        """Status (with loss history), config, checkpoints and the latest metrics row."""
        return self._run(describe_flow(self.id))

    def status(self) -> JobStatus:
        """QUEUED, RUNNING, COMPLETED, FAILED or CANCELLED, with step, loss and reason."""
        return self._run(status_flow(self.id))

    def wait(self, timeout: float | None = None, poll_seconds: float = DEFAULT_POLL_SECONDS,
             progress: bool | None = None) -> JobStatus:  # fmt: skip
        """Block until the job ends and return its final status; raise TrainingFailed with the reason on FAILED."""
        return self._run(wait_flow(self.id, timeout, poll_seconds, progress))

    def metrics(self) -> list[dict[str, Any]]:
        """One dict per step: step, loss, lr, grad norm, tokens/s, time."""
        return self._run(metrics_flow(self.id))

    def cancel(self) -> JobStatus:
        """Stop the job (the trainer saves its state first)."""
        return self._run(cancel_flow(self.id))

    def resume(self) -> JobStatus:
        """Relaunch the FAILED or CANCELLED job from its saved state."""
        return self._run(resume_flow(self.id))

    def delete(self) -> None:
        """Cancel the job if it runs and remove it from the server."""
        self._run(delete_flow(self.id))

    def plot(self, path: str | Path) -> Path:
        """Write this job's loss curve as a PNG."""
        return plot_metrics(self._run(metrics_flow(self.id)), path, _title(self.id))


class AsyncTrainingJob:
    """The awaitable twin of `TrainingJob`."""

    def __init__(self, run: AsyncRun, job_id: str, response: TrainResponse | None = None) -> None:
        self._run = run
        self.id = job_id
        self.response = response

    def __getitem__(self, key: str) -> Any:
        if self.response is None:
            raise KeyError(f"{key!r}: no response cached; await job.info()")
        return self.response.model_dump()[key]

    def __repr__(self) -> str:
        return f"AsyncTrainingJob({self.id!r})"

    async def info(self) -> TrainingJobResponse:
        return await self._run(describe_flow(self.id))

    async def status(self) -> JobStatus:
        return await self._run(status_flow(self.id))

    async def wait(self, timeout: float | None = None, poll_seconds: float = DEFAULT_POLL_SECONDS,
                   progress: bool | None = None) -> JobStatus:  # fmt: skip
        """Wait for the job to end; raise TrainingFailed with the reason on FAILED."""
        return await self._run(wait_flow(self.id, timeout, poll_seconds, progress))

    async def metrics(self) -> list[dict[str, Any]]:
        return await self._run(metrics_flow(self.id))

    async def cancel(self) -> JobStatus:
        return await self._run(cancel_flow(self.id))

    async def resume(self) -> JobStatus:
        return await self._run(resume_flow(self.id))

    async def delete(self) -> None:
        await self._run(delete_flow(self.id))

    async def plot(self, path: str | Path) -> Path:
        return plot_metrics(await self._run(metrics_flow(self.id)), path, _title(self.id))


class TrainingMethods:
    """Training methods of `ScalarLM` (mixed in; `_run` is the client's SyncRunner)."""

    _run: Run

    def train(self, data: Dataset, model_name: str | None = None, train_args: Mapping[str, Any] | None = None, *,
              single_post_threshold: int = SINGLE_POST_THRESHOLD, chunk_size: int = CHUNK_SIZE) -> TrainingJob:  # fmt: skip
        """Fine-tune on `data` (row dicts or a JSONL path); return the job handle at once."""
        return TrainingJob(self._run,
                           *self._run(train_flow(data, model_name, train_args, single_post_threshold, chunk_size)))

    def get_training_job(self, job_id: str) -> TrainingJob:
        """A handle on an existing job (its current description is fetched now; unknown ids raise NotFound)."""
        return TrainingJob(self._run, *self._run(job_flow(job_id)))

    def cancel(self, job: "str | TrainingJob") -> JobStatus:
        """Cancel a training job by id or handle (ScalarLM's `cancel(model_name)`)."""
        return self._run(cancel_flow(_job_id(job)))

    def resume(self, job: "str | TrainingJob") -> JobStatus:
        """Relaunch a FAILED or CANCELLED job from its saved state (Conflict if it runs or completed)."""
        return self._run(resume_flow(_job_id(job)))

    def delete(self, job: "str | TrainingJob") -> dict[str, Any]:
        """Delete a training job by id or handle (ScalarLM's `delete(model_name)`)."""
        return self._run(delete_flow(_job_id(job)))

    def plot(self, job: "str | TrainingJob", path: str | Path) -> Path:
        """Write the job's loss curve (step vs loss) as a PNG at `path`; return the path."""
        return plot_metrics(self._run(metrics_flow(_job_id(job))), path, _title(_job_id(job)))

    def get_logs(self, job: "str | TrainingJob") -> str:
        """The job's launcher output and rank logs."""
        return self._run(logs_flow(_job_id(job)))

    def list_checkpoints(self, job: "str | TrainingJob") -> dict[str, Any]:
        """The job's published checkpoints (versions) with kind and size."""
        return self._run(checkpoints_flow(_job_id(job)))

    def get_dataset(self, job: "str | TrainingJob", limit: int = 20) -> dict[str, Any]:
        """The job's row count and first rows."""
        return self._run(dataset_flow(_job_id(job), limit))

    def squeue(self) -> dict[str, Any]:
        """Training jobs the launchers hold (queued or running)."""
        return self._run(get_flow("/v1/megatron/squeue"))

    def request_status(self, request_id: str) -> dict[str, Any]:
        """One generate request's status and result (NotFound for an unknown id)."""
        return self._run(get_flow(f"/v1/generate/request/{request_id}"))

    def workers(self) -> dict[str, Any]:
        """The inference workers with the model versions each has loaded and its engine load."""
        return self._run(get_flow("/v1/generate/workers"))


class AsyncTrainingMethods:
    """Training methods of `AsyncScalarLM` (`_run` is the client's AsyncRunner)."""

    _run: AsyncRun

    async def train(self, data: Dataset, model_name: str | None = None, train_args: Mapping[str, Any] | None = None,
                    *, single_post_threshold: int = SINGLE_POST_THRESHOLD,
                    chunk_size: int = CHUNK_SIZE) -> AsyncTrainingJob:  # fmt: skip
        """Fine-tune on `data` (row dicts or a JSONL path); return the job handle at once."""
        return AsyncTrainingJob(
            self._run, *await self._run(train_flow(data, model_name, train_args, single_post_threshold, chunk_size))
        )

    async def get_training_job(self, job_id: str) -> AsyncTrainingJob:
        return AsyncTrainingJob(self._run, *await self._run(job_flow(job_id)))

    async def cancel(self, job: "str | AsyncTrainingJob") -> JobStatus:
        return await self._run(cancel_flow(_job_id(job)))

    async def resume(self, job: "str | AsyncTrainingJob") -> JobStatus:
        return await self._run(resume_flow(_job_id(job)))

    async def delete(self, job: "str | AsyncTrainingJob") -> dict[str, Any]:
        return await self._run(delete_flow(_job_id(job)))

    async def plot(self, job: "str | AsyncTrainingJob", path: str | Path) -> Path:
        """Write the job's loss curve as a PNG at `path`."""
        return plot_metrics(await self._run(metrics_flow(_job_id(job))), path, _title(_job_id(job)))

    async def get_logs(self, job: "str | AsyncTrainingJob") -> str:
        return await self._run(logs_flow(_job_id(job)))

    async def list_checkpoints(self, job: "str | AsyncTrainingJob") -> dict[str, Any]:
        return await self._run(checkpoints_flow(_job_id(job)))

    async def get_dataset(self, job: "str | AsyncTrainingJob", limit: int = 20) -> dict[str, Any]:
        return await self._run(dataset_flow(_job_id(job), limit))

    async def squeue(self) -> dict[str, Any]:
        return await self._run(get_flow("/v1/megatron/squeue"))

    async def request_status(self, request_id: str) -> dict[str, Any]:
        return await self._run(get_flow(f"/v1/generate/request/{request_id}"))

    async def workers(self) -> dict[str, Any]:
        return await self._run(get_flow("/v1/generate/workers"))
