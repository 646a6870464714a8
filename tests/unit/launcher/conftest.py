"""Job directories and stand-in trainer programs for launcher tests (real subprocesses, no mocks)."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from scalarlm.checkpoint import JobDir
from scalarlm.config import Settings
from scalarlm.protocol.training import JobStatus, TrainArgs, TrainJobConfig

# Programs run in place of `python -m scalarlm.training <job_dir>`; they follow the trainer's contract
# (status.json, metrics.jsonl, CANCELLED on SIGTERM when cancel.requested exists) as far as each test needs.
PROGRAMS = {
    # Reaches step 2, prints an error and dies without a final status (a crash the trainer could not report).
    "crash": """
        import json, sys, pathlib
        job = pathlib.Path(sys.argv[1])
        with open(job / "metrics.jsonl", "a") as f:
            for step in (1, 2):
                f.write(json.dumps({"step": step, "loss": 3.0 / step}) + "\\n")
        print("RuntimeError: out of memory in step 3", flush=True)
        sys.exit(3)
    """,
    # Renames step-2 into place, then dies before it points `latest` at it (the pointer still names step-1).
    "crash_before_pointer": """
        import json, sys, pathlib
        job = pathlib.Path(sys.argv[1])
        for step in (1, 2):
            (job / "checkpoints" / f"step-{step}").mkdir(parents=True)
            (job / "checkpoints" / f"step-{step}" / "manifest.json").write_text(json.dumps({"step": step}))
        (job / "checkpoints" / "latest").write_text("step-1\\n")
        sys.exit(9)
    """,
    # Publishes step-1 durably, stages step-2 in memory (argv[1]: the staging folder, before the job directory) and
    # dies before its landing.
    "crash_before_landing": """
        import json, sys, pathlib
        shm, job = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
        def manifest(step):
            return json.dumps({"job_id": job.name, "step": step, "base_model": "b", "kind": "full"})
        (job / "checkpoints" / "step-1").mkdir(parents=True)
        (job / "checkpoints" / "step-1" / "manifest.json").write_text(manifest(1))
        (job / "checkpoints" / "latest").write_text("step-1\\n")
        staged = shm / job.name / "step-2"
        staged.mkdir(parents=True)
        (staged / "model.safetensors").write_bytes(b"weights of step 2")
        (staged / "manifest.json").write_text(manifest(2))
        (job / "checkpoints" / "staged").write_text(f"step-2 {staged}\\n")
        sys.exit(9)
    """,
    # Runs until SIGTERM, then writes CANCELLED (cancel.requested present), QUEUED (shutdown.requested) or FAILED,
    # like the trainer.
    "obedient": """
        import json, os, signal, sys, time, pathlib
        job = pathlib.Path(sys.argv[1])
        def write(status, reason):
            s = json.loads((job / "status.json").read_text())
            s.update(status=status, reason=reason)
            (job / "status.json.tmp").write_text(json.dumps(s)); os.replace(job / "status.json.tmp", job / "status.json")
        def on_term(signum, frame):
            if (job / "cancel.requested").exists():
                write("CANCELLED", "cancelled at step 1 (state saved)")
            elif (job / "shutdown.requested").exists():
                write("QUEUED", "stopped at step 1 by the control plane's shutdown (state saved)")
            else:
                write("FAILED", "terminated by SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        write("RUNNING", None)
        print("running", flush=True)
        while True:
            time.sleep(0.05)
    """,
    # Ignores SIGTERM: the launcher must escalate to SIGKILL.
    "stubborn": """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        while True:
            time.sleep(0.05)
    """,
    # Finishes its work and reports it.
    "complete": """
        import json, os, sys, pathlib
        job = pathlib.Path(sys.argv[1])
        s = json.loads((job / "status.json").read_text())
        s.update(status="COMPLETED", step=5)
        (job / "status.json.tmp").write_text(json.dumps(s)); os.replace(job / "status.json.tmp", job / "status.json")
    """,
}


# "obedient", after writing the GPUs it was given (CUDA_VISIBLE_DEVICES) to `devices.<rank>` in the job directory.
PROGRAMS["devices"] = """
        import os, pathlib, sys
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
        out = pathlib.Path(sys.argv[1]) / f"devices.{rank}"
        out.with_suffix(".tmp" + rank).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
        os.replace(out.with_suffix(".tmp" + rank), out)
""" + PROGRAMS["obedient"]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", model=str(tmp_path / "model"))


@pytest.fixture
def program(tmp_path: Path):
    """program(name) -> the entry (argv after python) running that stand-in trainer."""

    def make(name: str) -> list[str]:
        path = tmp_path / f"{name}_trainer.py"
        path.write_text(textwrap.dedent(PROGRAMS[name]))
        return [str(path)]

    return make


@pytest.fixture
def new_job(settings: Settings):
    """new_job(**train_args) -> (JobDir, TrainJobConfig) written as the control plane would, status QUEUED."""
    counter = iter(range(1000))

    def make(**train_args) -> tuple[JobDir, TrainJobConfig]:
        job = JobDir.under(settings.jobs_dir, f"job-test-{next(counter)}")
        job.create()
        config = TrainJobConfig(job_id=job.job_id, base_model=settings.model, train_args=TrainArgs(**train_args),
                                created=time.time())  # fmt: skip
        job.write_config(config)
        job.write_status(JobStatus(job_id=job.job_id, max_steps=config.train_args.max_steps))
        return job, config

    return make


def poll_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until true or `timeout` seconds pass (machines here are slow and shared)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())



@pytest.fixture
def wait_for():
    """wait_for(predicate, timeout=30) -> bool: poll until the predicate holds."""
    return poll_until
