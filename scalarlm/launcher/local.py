"""`LocalLauncher`: the trainer as a subprocess of this machine, one plain process or `mpirun -n <ranks>`."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.staging import STAGING_ENV, staging_root
from scalarlm.config import Settings
from scalarlm.launcher.base import (
    NOTIFY_ENV,
    NOTIFY_KEY_ENV,
    LaunchRecord,
    RunState,
    log_path,
    notify_key,
    notify_url,
    read_logs,
    read_record,
    request_cancel,
    request_shutdown_stop,
    write_record,
)
from scalarlm.launcher.process import is_alive, signal_group, start_ticks
from scalarlm.protocol.errors import EngineUnavailable, InvalidRequest
from scalarlm.protocol.training import TrainArgs, TrainJobConfig

logger = logging.getLogger(__name__)

TRAINER_ENTRY: tuple[str, ...] = ("-m", "scalarlm.training")
# The launch record's id while a job waits for a free slot (no process yet).
WAITING = "waiting"


# Where a GPU node's server may have been given its devices (CUDA, then ROCm's HIP, which also reads the CUDA name).
DEVICE_ENVS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def node_devices(gpus_per_node: int, environ: dict[str, str]) -> tuple[str, list[str]]:
    """The variable that names this node's GPUs for the trainers, and the `gpus_per_node` devices it may name: the
    server's own CUDA_VISIBLE_DEVICES (or HIP_VISIBLE_DEVICES) when set, else 0 .. gpus_per_node - 1."""
    for name in DEVICE_ENVS:
        value = environ.get(name, "").strip()
        if value:
            return name, [d.strip() for d in value.split(",") if d.strip()][:gpus_per_node]
    return DEVICE_ENVS[0], [str(i) for i in range(gpus_per_node)]


def free_port() -> int:
    """A TCP port free right now on loopback (for torch.distributed's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A running job as the slots see it: its directory, the GPUs it asked for, and the devices it was given (None: not
# recorded, a job on a node without `gpus_per_node` or started before devices were recorded).
Running = tuple[JobDir, int, list[str] | None]


class LocalLauncher:
    """Runs `python -m scalarlm.training <job_dir>` here; several ranks go through Open MPI's `mpirun`."""

    name = "local"

    def __init__(
        self,
        settings: Settings,
        *,
        python: str = sys.executable,
        entry: Sequence[str] = TRAINER_ENTRY,
        grace_seconds: float | None = None,
    ) -> None:
        self.settings = settings
        self.python = python
        self.entry = list(entry)
        self.grace_seconds = settings.training.stop_grace_seconds if grace_seconds is None else grace_seconds
        # Our own children, so their exit codes are known and they do not linger as zombies.
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    def command(self, job: JobDir, config: TrainJobConfig, device_env: str | None = None) -> list[str]:
        """The command line that runs the job's ranks (`device_env`: the variable naming the job's GPUs, passed on
        to every rank)."""
        trainer = [self.python, *self.entry, str(job.root)]
        ranks = config.train_args.world_size
        if ranks == 1:
            return trainer
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise EngineUnavailable(f"a job with {ranks} ranks needs Open MPI's mpirun, which is not installed")
        cmd = [mpirun, "-n", str(ranks), "--bind-to", "none"]
        if config.train_args.gpus == 0 or ranks > (os.cpu_count() or 1):
            cmd.append("--oversubscribe")  # CPU ranks may outnumber the cores Open MPI counts as slots
        for var in ("MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"):
            cmd += ["-x", var]
        if notify_url(self.settings) is not None:
            cmd += ["-x", NOTIFY_ENV, "-x", NOTIFY_KEY_ENV]  # names only: the key stays out of argv and the record
        if self._staging() is not None:
            cmd += ["-x", STAGING_ENV]
        if device_env is not None:
            cmd += ["-x", device_env]
        return cmd + trainer

    def _staging(self) -> Path | None:
        """Where the trainer stages full weights: only where the engine on this host reads them (embedded node)."""
        if self.settings.server.role != "embedded":
            return None
        return staging_root(self.settings.training.staging_dir, self.settings.home)

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("PYTHONPATH", "")
        env["MASTER_ADDR"] = "127.0.0.1"
        env["MASTER_PORT"] = str(free_port())
        env["PYTHONUNBUFFERED"] = "1"
        env["HF_HUB_OFFLINE"] = "1"  # the trainer gets a resolved local directory: a hub call would be a bug, not a wait
        for name in (NOTIFY_ENV, NOTIFY_KEY_ENV, STAGING_ENV):  # never inherited from this process
            env.pop(name, None)
        staging = self._staging()
        if staging is not None:
            env[STAGING_ENV] = str(staging)
        url = notify_url(self.settings)
        if url is not None:
            env[NOTIFY_ENV] = url  # the trainer announces each published step there (best effort)
            env[NOTIFY_KEY_ENV] = notify_key(self.settings.home)  # valid on that one route only
        if os.geteuid() == 0:  # Open MPI refuses root without these
            env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
            env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        return env

    def submit(self, job: JobDir, config: TrainJobConfig) -> str:
        """Start the job's processes now when a slot is free (`training.max_running_jobs`, and this node's GPUs for a
        GPU job); else record it as waiting, QUEUED, for `admit` to start in submission order. InvalidRequest for
        a job no slot could ever take (it would wait for ever, and hold back every job submitted after it)."""
        self._check_fits(config.train_args)
        running = None
        if self._limited():
            waiting, running = self._slots()
            ahead = sum(1 for queued, _ in waiting if queued.job_id != job.job_id)
            busy = self._busy(config.train_args.gpus, running, ahead)
            if busy is not None:
                write_record(job, LaunchRecord(launcher="local", launcher_id=WAITING, submitted=time.time()))
                job.update_status(reason=f"waiting for a free trainer slot: {busy}")
                logger.info("job %s: waiting for a free trainer slot: %s", job.job_id, busy)
                return WAITING
        return self._start(job, config, running)

    def _check_fits(self, args: TrainArgs) -> None:
        """InvalidRequest unless this node can run the job: its ranks all run here."""
        per_node = self.settings.training.gpus_per_node
        if args.nodes > 1:
            raise InvalidRequest(f"nodes {args.nodes}: the local launcher runs a job's ranks on this one node; use "
                                 "the slurm launcher (train arg launcher 'slurm') for more nodes", param="nodes")
        if args.gpus and per_node and args.gpus > per_node:
            raise InvalidRequest(f"gpus {args.gpus} exceeds the {per_node} GPUs of this node "
                                 "(training.gpus_per_node)", param="gpus")  # fmt: skip

    def _slots(self) -> tuple[list[tuple[JobDir, LaunchRecord]], list[Running]]:
        """This launcher's jobs that are not finished: those waiting (oldest first) and those running (with
        the GPUs each holds, and which when it was given them)."""
        waiting, running = [], []
        jobs_dir = self.settings.jobs_dir
        for root in sorted(p for p in jobs_dir.iterdir() if p.is_dir()) if jobs_dir.exists() else []:
            job = JobDir(root)
            record = read_record(job)
            if record is None or record.launcher != "local":
                continue
            try:
                if job.read_status().terminal:
                    continue
                if record.launcher_id == WAITING:
                    waiting.append((job, record))
                elif self.state(job)[0] == "running":
                    running.append((job, job.read_config().train_args.gpus, record.devices))
            except (OSError, ValueError):
                continue
        waiting.sort(key=lambda pair: pair[1].submitted)
        return waiting, running

    def _limited(self) -> bool:
        training = self.settings.training
        return training.max_running_jobs > 0 or training.gpus_per_node > 0

    def _busy(self, gpus: int, running: list[Running], ahead: int = 0) -> str | None:
        """Why a job of `gpus` GPUs cannot start now beside the `running` ones (None: it can): `ahead` jobs submitted
        before it still wait, the job limit is reached, or its GPUs are taken."""
        training = self.settings.training
        if ahead:
            return f"{ahead} jobs submitted before it wait first"
        if training.max_running_jobs and len(running) >= training.max_running_jobs:
            return f"{len(running)} of training.max_running_jobs={training.max_running_jobs} trainers run"
        taken = sum(n for _, n, _ in running)
        if training.gpus_per_node and gpus and taken + gpus > training.gpus_per_node:
            return f"it needs {gpus} GPUs and {taken} of this node's {training.gpus_per_node} are taken"
        return None

    def admit(self) -> list[str]:
        """Start waiting jobs in submission order while they fit (a job that does not fit blocks those after it,
        so a large job is not starved by small ones)."""
        if not self._limited():
            return []
        waiting, running = self._slots()
        started = []
        for job, _ in waiting:
            try:
                config = job.read_config()
            except (OSError, ValueError):
                continue
            if self._busy(config.train_args.gpus, running) is not None:
                break
            launcher_id = self._start(job, config, running)
            job.update_status(launcher_id=launcher_id, reason=None)
            running.append((job, config.train_args.gpus, read_record(job).devices))
            started.append(job.job_id)
        return started

    def _devices(self, gpus: int, running: list[Running] | None) -> tuple[str, list[str]] | None:
        """On a GPU node (`training.gpus_per_node` > 0), the variable and the devices to give a job of `gpus` GPUs:
        the first ones no running job holds (none for a CPU job, so it cannot take a GPU it did not ask for); None
        elsewhere (the trainer's ranks see what this process sees)."""
        per_node = self.settings.training.gpus_per_node
        if not per_node:
            return None
        name, devices = node_devices(per_node, dict(os.environ))
        if running is None:
            running = self._slots()[1]
        held = {d for _, _, given in running for d in given or []}
        free = [d for d in devices if d not in held]
        # Jobs started before devices were recorded hold the first free ones, as they were given then.
        unknown = sum(n for _, n, given in running if given is None)
        return name, free[unknown:unknown + gpus]

    def _start(self, job: JobDir, config: TrainJobConfig, running: list[Running] | None = None) -> str:
        """Start the job's processes in a new session (so cancel can signal the whole group); on a GPU node with
        the devices it is given (`_devices`)."""
        env = self._environment()
        given = self._devices(config.train_args.gpus, running)
        if given is not None:
            env[given[0]] = ",".join(given[1])
        cmd = self.command(job, config, given[0] if given is not None else None)
        job.logs_dir.mkdir(parents=True, exist_ok=True)
        with open(log_path(job), "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )  # fmt: skip
        self._children[job.job_id] = proc
        # Reap the child the moment it exits, so finished jobs leave no zombie behind.
        threading.Thread(target=proc.wait, name=f"reap-{job.job_id}", daemon=True).start()
        record = LaunchRecord(
            launcher="local", launcher_id=str(proc.pid), pid=proc.pid, start_ticks=start_ticks(proc.pid),
            command=cmd, submitted=time.time(), devices=given[1] if given is not None else None,
        )  # fmt: skip
        write_record(job, record)
        logger.info("job %s: started pid %d: %s", job.job_id, proc.pid, " ".join(cmd))
        return record.launcher_id

    def state(self, job: JobDir) -> tuple[RunState, str | None]:
        """Running while the launched process lives; finished with its exit code when known."""
        record = read_record(job)
        if record is not None and record.launcher_id == WAITING:
            return "waiting", "waiting for a free trainer slot"
        if record is None or record.pid is None:
            return "unknown", "the job was never started by a launcher"
        child = self._children.get(job.job_id)
        if child is not None:
            code = child.poll()
            if code is None:
                return "running", None
            return "finished", f"trainer process {record.pid} {describe_exit(code)}"
        if record.host != socket.gethostname():
            return "unknown", f"the job was launched on host {record.host}, not this one"
        if is_alive(record.pid, record.start_ticks):
            return "running", None
        return "finished", f"trainer process {record.pid} exited"

    def _wait_gone(self, job: JobDir, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.state(job)[0] != "running":
                return True
            time.sleep(0.1)
        return self.state(job)[0] != "running"

    def cancel(self, job: JobDir) -> None:
        """Ask the trainer to stop (SIGTERM to its group, it saves state), SIGKILL after the grace period."""
        request_cancel(job)
        record = read_record(job)
        if record is not None and record.pid is not None and self.state(job)[0] == "running":
            signal_group(record.pid, signal.SIGTERM)
            if not self._wait_gone(job, self.grace_seconds):
                logger.warning("job %s: no exit %.0f s after SIGTERM, sending SIGKILL", job.job_id, self.grace_seconds)
                signal_group(record.pid, signal.SIGKILL)
                self._wait_gone(job, 10.0)
        mark_cancelled(job)

    def stop_for_shutdown(self, jobs: Sequence[JobDir]) -> list[str]:
        """Ask every job of `jobs` running here to save state and stop (it ends QUEUED, to be resumed); SIGKILL
        whatever still runs after the grace period. Returns the ids of the jobs it stopped."""
        running = [job for job in jobs if self.state(job)[0] == "running"]
        for job in running:
            request_shutdown_stop(job)  # rank 0 sees it at the next step boundary, even under mpirun
            record = read_record(job)
            # mpirun SIGKILLs its ranks 1 s after forwarding a SIGTERM, which may cut the save short: ranks of a
            # multi-rank job stop through the marker alone.
            if record is not None and record.pid is not None and not _is_mpirun(record.command):
                signal_group(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        while time.monotonic() < deadline and any(self.state(job)[0] == "running" for job in running):
            time.sleep(0.1)
        for job in running:
            record = read_record(job)
            if record is not None and record.pid is not None and self.state(job)[0] == "running":
                logger.warning("job %s: still running %.0f s after the stop request, sending SIGKILL", job.job_id,
                               self.grace_seconds)  # fmt: skip
                signal_group(record.pid, signal.SIGKILL)
                self._wait_gone(job, 10.0)
        return [job.job_id for job in running]

    def logs(self, job: JobDir) -> str:
        return read_logs(job)


def _is_mpirun(command: Sequence[str]) -> bool:
    return bool(command) and os.path.basename(command[0]) == "mpirun"


def describe_exit(code: int) -> str:
    """'exited with code 3' or 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def mark_cancelled(job: JobDir) -> None:
    """Status CANCELLED unless the trainer already wrote a final status."""
    status = job.read_status() if job.status_path.exists() else None
    if status is None or not status.terminal:
        job.update_status(status="CANCELLED", reason="cancelled by user", end_time=time.time())
