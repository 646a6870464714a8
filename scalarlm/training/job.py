"""One training job on one rank: logging, signals, status.json, validation, training, outcome.

Rank 0 writes status.json (RUNNING -> COMPLETED | FAILED | CANCELLED with a reason) and metrics.jsonl; any rank
that fails writes FAILED with its exception. The dataset is validated before any process group or model exists.
On SIGTERM, or when `cancel.requested` or `shutdown.requested` appears in the job directory (polled by rank 0
every step), the ranks agree at the next step boundary, save resume state and exit 0: CANCELLED if
`cancel.requested` exists; QUEUED (to be resumed by the restarted control plane) if `shutdown.requested` exists;
else FAILED with a "state saved, resume the job" reason. A job started on a directory whose `state/` holds a saved
state resumes from it.

Under mpirun prefer the cancel file (or SIGTERM to the ranks themselves): Open MPI's mpirun forwards SIGTERM but
SIGKILLs the ranks `odls_base_sigkill_timeout` (default 1 s) later, which may cut a save short.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.jobdir import atomic_write_text
from scalarlm.protocol.errors import ScalarLMError
from scalarlm.training.launch_env import launch_env_from
from scalarlm.training.grpo import read_rl_dataset
from scalarlm.training.rows import read_rows

logger = logging.getLogger(__name__)

class StopSignal:
    """Remembers that SIGTERM (or SIGINT) arrived; the loop checks it between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> "StopSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        logger.warning("received %s: stopping at the next step boundary", signal.Signals(signum).name)

    def requested(self) -> bool:
        return self.signum is not None


def setup_logging(job: JobDir, rank: int) -> None:
    """Log every rank to logs/rank-<r>.log; rank 0 also to stderr (others only warnings)."""
    job.logs_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    to_file = logging.FileHandler(job.rank_log(rank))
    to_file.setFormatter(fmt)
    to_err = logging.StreamHandler(sys.stderr)
    to_err.setFormatter(fmt)
    to_err.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.handlers[:] = [to_file, to_err]
    logging.captureWarnings(True)


DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _fail(job: JobDir, reason: str, step: int | None = None) -> int:
    """Record FAILED with `reason`; return the exit code of a failed rank."""
    logger.error("job failed: %s", reason)
    changes: dict[str, Any] = {"status": "FAILED", "reason": reason, "end_time": time.time()}
    if step is not None:
        changes["step"] = step
    job.update_status(**changes)
    return 1


def no_gpu_reason(gpus: int, environ: Mapping[str, str]) -> str:
    """Why a job that asks for GPUs stops on a node where torch sees none (a driver missing, or device variables
    that hide them all: ROCm applies CUDA_VISIBLE_DEVICES after renumbering by ROCR_VISIBLE_DEVICES)."""
    seen = ", ".join(f"{k}={environ[k]!r}" for k in DEVICE_VARIABLES if k in environ) or "none of them set"
    return (f"the job asks for {gpus} GPU(s) a node and torch sees none on this node ({', '.join(DEVICE_VARIABLES)}: "
            f"{seen}): check the node's GPU driver and that the device variables name its devices once")


def _keep_metrics_up_to(job: JobDir, step: int) -> None:
    """Drop metrics of steps after the state we start from (they are trained again)."""
    rows = [r for r in job.read_metrics() if int(r.get("step", 0)) <= step]
    atomic_write_text(job.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))


def run_job(job_dir: Path, environ: Mapping[str, str]) -> int:
    """Run the job in `job_dir` as the rank described by `environ`; return the process exit code."""
    job = JobDir(Path(job_dir))
    env = launch_env_from(environ)
    setup_logging(job, env.rank)
    stop = StopSignal().install()
    main = env.rank == 0
    try:
        config = job.read_config()
        rl = config.train_args.loss != "sft"
        rows = [] if config.session or rl else read_rows(job.dataset_path)
        rl_rows = read_rl_dataset(job.dataset_path) if rl and not config.session else None
    except (ScalarLMError, ValidationError, OSError, ValueError) as e:
        return _fail(job, f"{type(e).__name__}: {e}") if main else 1
    args = config.train_args
    clock = TimeLimit(config.time_limit)  # model loading counts, as it does under SLURM's --time
    if main:
        job.create()
        job.update_status(status="RUNNING", reason=None, max_steps=args.max_steps, start_time=time.time(), end_time=None)

    import torch

    from scalarlm.training.loop import Trainer, run
    from scalarlm.training.parallel import init_parallel, shutdown_parallel
    from scalarlm.training.session_loop import run_session
    from scalarlm.training.tensorboard_log import TensorBoardLog

    if args.gpus and not torch.cuda.is_available():  # a GPU job never trains on this node's CPU instead
        return _fail(job, no_gpu_reason(args.gpus, environ)) if main else 1
    torch.manual_seed(args.seed)
    trainer = None
    board: TensorBoardLog | None = None
    try:
        par = init_parallel(env, args.tensor_parallel_size, args.seed, gpu_memory_fraction=config.gpu_memory_fraction,
                            expert_parallel_size=args.expert_parallel_size, cpu_threads=config.cpu_threads,
                            cpu_threads_overlapped=config.cpu_threads_overlapped)
        trainer = Trainer(job, config, par, rows, rl_rows)
        trainer.resume_if_saved()
        data = trainer.data_report()
        if main:
            _keep_metrics_up_to(job, trainer.step)
            logger.info("data: %s", data)
            job.update_status(step=trainer.step, details={"data": data})

        board = TensorBoardLog(job.root) if main else None

        def on_step(metrics: dict[str, Any]) -> None:
            if board is not None:
                metrics.setdefault("truncated_rows", data["truncated_rows"])
                job.append_metrics(metrics)
                board.write(metrics)
                job.update_status(step=metrics["step"], loss=metrics["loss"])
                logger.info("step %d loss %.5f lr %.3g tok/s %.0f", metrics["step"], metrics["loss"], metrics["lr"],
                            metrics["tokens_per_second"])

        markers = (job.cancel_marker, job.shutdown_marker)

        def stop_requested() -> bool:
            return stop.requested() or (main and (clock.expired() or any(m.exists() for m in markers)))

        loop = run_session if config.session else run
        outcome = loop(trainer, stop_requested, on_step)
    except Exception as e:  # the entry point turns any failure into FAILED with its reason
        logger.exception("training failed")
        if trainer is not None:
            _land_what_was_staged(trainer)
        step = trainer.step if trainer is not None else None
        return _fail(job, f"rank {env.rank}: {type(e).__name__}: {e}", step)
    finally:
        if board is not None:
            board.close()
        shutdown_parallel()

    if main:
        _record_outcome(job, outcome, trainer.step, stop, clock)
    return 0


def _land_what_was_staged(trainer: Any) -> None:
    """After a failure, still write the durable copy of a step already staged (and served)."""
    try:
        trainer.finish_publishing()
    except Exception:  # the job's failure is the one to report
        logger.exception("the staged checkpoint could not be landed")


class TimeLimit:
    """The run's time budget (`timeout` / `training.max_train_seconds`), counted from the trainer's start."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()
        self.hit = False

    def expired(self) -> bool:
        """True once the budget is spent (and remembered, so the outcome can say why the job stopped)."""
        self.hit = self.hit or time.monotonic() - self.started > self.seconds
        return self.hit


def _record_outcome(job: JobDir, outcome: str, step: int, stop: StopSignal, clock: TimeLimit) -> None:
    """Write the final status of a job that ended without an error."""
    now = time.time()
    if outcome == "completed":
        job.update_status(status="COMPLETED", reason=None, step=step, end_time=now)
    elif clock.hit and not job.cancel_marker.exists() and not job.shutdown_marker.exists():
        reason = (f"stopped at step {step}: the time limit of {clock.seconds:g} s (train_args.timeout, capped by "
                  "training.max_train_seconds) ran out; state saved, resume the job to continue from it")
        job.update_status(status="FAILED", reason=reason, step=step, end_time=now)
    elif job.cancel_marker.exists():
        # An idle RL session cancels itself and leaves its reason in the marker.
        reason = job.cancel_marker.read_text().strip() if outcome == "idle" else f"cancelled at step {step}"
        job.update_status(status="CANCELLED", reason=reason, end_time=now)
    elif job.shutdown_marker.exists():
        reason = f"stopped at step {step} by the control plane's shutdown; state saved, resumes when it restarts"
        job.update_status(status="QUEUED", reason=reason, step=step, end_time=None)
    else:
        name = signal.Signals(stop.signum).name if stop.signum else "a stop request on another rank"
        reason = f"terminated by {name} at step {step}; state saved, resume the job to continue from it"
        job.update_status(status="FAILED", reason=reason, step=step, end_time=now)
    logger.info("job %s: %s at step %d", job.job_id, outcome, step)
