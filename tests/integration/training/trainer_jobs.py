"""Helpers for trainer tests: job directories and real `python -m scalarlm.training` runs (one process or mpirun).

Imported by the test modules next to it (pytest puts this folder on sys.path; the name is unique in the suite).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.session import SessionDir
from scalarlm.protocol.training import TrainArgs, TrainJobConfig

# Short question -> answer pairs the tiny model memorises in a few dozen steps.
QA = [
    ("What is the capital of France?", "Paris"),
    ("What is two plus two?", "four"),
    ("Who lives by the sea?", "a little cat"),
    ("What does a model learn from?", "data"),
    ("What color is the fox?", "brown"),
    ("What is the weather like?", "nice and sunny"),
    ("What do we serve?", "language models"),
    ("What is 3 + 3?", "6"),
]


def qa_rows() -> list[dict[str, str]]:
    return [{"input": q + " ", "output": a} for q, a in QA]


def mpi_env() -> dict[str, str]:
    """Environment for real mpirun as root on a small box."""
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def make_job(root: Path, job_id: str, base_model: Path, rows: list[Any] | str, **train_args: Any) -> JobDir:
    """Write jobs/<id>/ (job.yaml + dataset.jsonl) as the control plane would."""
    job = JobDir(root / job_id)
    job.create()
    config = TrainJobConfig(job_id=job_id, base_model=str(base_model), train_args=TrainArgs(**train_args))
    job.write_config(config)
    text = rows if isinstance(rows, str) else "".join(json.dumps(r) + "\n" for r in rows)
    job.dataset_path.write_text(text)
    return job


def trainer_command(job: JobDir, ranks: int) -> list[str]:
    entry = [sys.executable, "-m", "scalarlm.training", str(job.root)]
    if ranks == 1:
        return entry
    return [shutil.which("mpirun") or "mpirun", "-n", str(ranks), "--oversubscribe", *entry]


def start_trainer(job: JobDir, ranks: int = 1) -> subprocess.Popen:
    """Start the trainer in its own session (so a test can signal exactly it)."""
    log = open(job.root / f"trainer-{time.time_ns()}.out", "w")
    return subprocess.Popen(
        trainer_command(job, ranks), env=mpi_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def run_trainer(job: JobDir, ranks: int = 1, timeout: float = 300) -> int:
    """Run the trainer to the end; return its exit code."""
    proc = start_trainer(job, ranks)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class SessionTrainer:
    """A session trainer (`python -m scalarlm.training <job_dir>` of a session job) in its own process group, output
    appended to `trainer-session.out`. As a context manager: started on entry; on a clean exit asked to end (it must
    exit 0); its group killed if it still runs, whatever happened. `kill()` then `start()` restarts it."""

    def __init__(self, job: JobDir, env: dict[str, str] | None = None) -> None:
        self.job, self.files, self.env = job, SessionDir(job), env or mpi_env()
        self.proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        with open(self.job.root / "trainer-session.out", "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "scalarlm.training", str(self.job.root)], env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        return self.proc

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> "SessionTrainer":
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None:
        assert self.proc is not None
        try:
            if exc_type is None:
                self.files.request_end()
                assert self.proc.wait(timeout=120) == 0, trainer_output(self.job)
        finally:
            if self.proc.poll() is None:
                self.kill()


def child_pids(proc: subprocess.Popen) -> list[int]:
    """Direct children of `proc` (mpirun's ranks on one node)."""
    path = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def losses(job: JobDir) -> list[float]:
    rows = job.read_metrics()
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "metrics must hold each step once, in order"
    return [r["loss"] for r in rows]


def trainer_output(job: JobDir) -> str:
    return "\n".join(p.read_text()[-4000:] for p in sorted(job.root.glob("trainer-*.out")))


def require_mpirun() -> None:
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun is missing: run `bash scripts/install.sh` (installs openmpi-bin)")
