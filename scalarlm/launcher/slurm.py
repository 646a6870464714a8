"""`SlurmLauncher`: the trainer as a SLURM batch job (`sbatch --parsable`, `squeue`/`sacct -c`/`scontrol`, `scancel`)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from scalarlm.checkpoint import JobDir
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
    write_record,
)
from scalarlm.launcher.local import TRAINER_ENTRY, mark_cancelled
from scalarlm.launcher.sbatch_script import render_sbatch
from scalarlm.protocol.errors import EngineUnavailable
from scalarlm.protocol.training import TrainJobConfig

logger = logging.getLogger(__name__)

# States in which a SLURM job has not finished yet (COMPLETING: processes are still exiting).
ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "STAGE_OUT", "SIGNALING"}
)
SBATCH_FILE = "sbatch.sh"


class SlurmLauncher:
    """Submits each job as an sbatch script in its job directory; SLURM runs the ranks."""

    name = "slurm"

    def __init__(
        self,
        settings: Settings,
        *,
        python: str = sys.executable,
        entry: Sequence[str] = TRAINER_ENTRY,
        launch: str = "srun",
        grace_seconds: float = 30.0,
    ) -> None:
        self.settings = settings
        self.python = python
        self.entry = list(entry)
        self.launch = launch
        self.grace_seconds = grace_seconds

    def script(self, job: JobDir, config: TrainJobConfig) -> str:
        """The sbatch script for `job`."""
        return render_sbatch(
            config, self.settings, job_root=str(job.root), log=str(log_path(job)), python=self.python,
            entry=self.entry, launch=self.launch,
            notify=notify_url(self.settings, remote=True) is not None,
        )  # fmt: skip

    def sbatch_environment(self) -> dict[str, str]:
        """sbatch's environment: ours plus the notify URL and key, which `--export=ALL` hands to every rank.

        The key travels this way, never in the script file (which any reader of the job directory could see).
        """
        env = dict(os.environ)
        for name in (NOTIFY_ENV, NOTIFY_KEY_ENV):  # never inherited from this process
            env.pop(name, None)
        env["HF_HUB_OFFLINE"] = "1"  # the ranks get a resolved local directory: never a download that hangs
        url = notify_url(self.settings, remote=True)
        if url is not None:
            env[NOTIFY_ENV] = url
            env[NOTIFY_KEY_ENV] = notify_key(self.settings.home)
        return env

    def _run(self, *cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        except FileNotFoundError as e:
            raise EngineUnavailable(f"SLURM command {cmd[0]!r} is not installed") from e
        except subprocess.TimeoutExpired as e:
            raise EngineUnavailable(f"SLURM command {' '.join(cmd)} timed out") from e

    def submit(self, job: JobDir, config: TrainJobConfig) -> str:
        """Write `sbatch.sh` into the job directory and submit it; the SLURM job id is the launcher id."""
        job.logs_dir.mkdir(parents=True, exist_ok=True)
        path = job.root / SBATCH_FILE
        path.write_text(self.script(job, config))
        done = self._run("sbatch", "--parsable", "--export=ALL", str(path), env=self.sbatch_environment())
        if done.returncode != 0:
            raise EngineUnavailable(f"sbatch failed: {done.stderr.strip() or done.stdout.strip()}")
        slurm_id = done.stdout.strip().split(";")[0]
        write_record(job, LaunchRecord(launcher="slurm", launcher_id=slurm_id, command=["sbatch", str(path)],
                                       submitted=time.time()))  # fmt: skip
        logger.info("job %s: submitted SLURM job %s", job.job_id, slurm_id)
        return slurm_id

    def slurm_state(self, slurm_id: str) -> tuple[str, str] | None:
        """(STATE, exit code) from squeue, then `sacct -c` (no slurmdbd needed), then scontrol; None if SLURM forgot it.

        Raises EngineUnavailable when SLURM cannot be asked at all (so a job is never failed for a controller outage).
        """
        done = self._run("squeue", "-h", "-t", "all", "-j", slurm_id, "-o", "%T")
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.split()[0], ""
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            raise EngineUnavailable(f"squeue failed: {done.stderr.strip()}")
        done = self._run("sacct", "-c", "-n", "-P", "-j", slurm_id, "-o", "JobID,State,ExitCode")
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            parts = line.split("|")
            if len(parts) >= 3 and parts[0] == slurm_id:
                return parts[1].split()[0], parts[2]
        done = self._run("scontrol", "show", "job", slurm_id)
        if done.returncode == 0:
            fields = dict(tok.split("=", 1) for tok in done.stdout.split() if "=" in tok)
            if "JobState" in fields:
                return fields["JobState"], fields.get("ExitCode", "")
        return None

    def state(self, job: JobDir) -> tuple[RunState, str | None]:
        """Running while SLURM has the job active; finished with SLURM's final state otherwise."""
        record = read_record(job)
        if record is None:
            return "unknown", "the job was never submitted to SLURM"
        try:
            found = self.slurm_state(record.launcher_id)
        except EngineUnavailable as e:
            return "unknown", e.message
        if found is None:
            return "finished", f"SLURM job {record.launcher_id} is gone (no longer known to SLURM)"
        state, exit_code = found
        if state in ACTIVE_STATES:
            return "running", None
        suffix = f" (exit code {exit_code})" if exit_code else ""
        return "finished", f"SLURM job {record.launcher_id} ended {state}{suffix}"

    def cancel(self, job: JobDir) -> None:
        """Stop a running job's ranks with SIGTERM (they save their state), then end what is left after
        `grace_seconds` with a plain scancel (SIGTERM to every step, SIGKILL after SLURM's KillWait). The first
        signal goes to the ranks' step only (`--signal=TERM`; under mpirun, the batch shell, which passes it on): srun
        answers a SIGTERM of its own by SIGKILLing every rank, which a plain scancel would have sent it."""
        request_cancel(job)
        record = read_record(job)
        if record is not None and self.state(job)[0] == "running":
            found = self.slurm_state(record.launcher_id)
            if found is not None and found[0] == "RUNNING":
                batch = ["--batch"] if self.launch == "mpirun" else []
                self._run("scancel", "--signal=TERM", *batch, record.launcher_id)
                self._wait_finished(job)
            if self.state(job)[0] == "running":
                self._run("scancel", record.launcher_id)
                self._wait_finished(job)
        mark_cancelled(job)

    def _wait_finished(self, job: JobDir) -> None:
        deadline = time.monotonic() + self.grace_seconds
        while time.monotonic() < deadline and self.state(job)[0] == "running":
            time.sleep(0.5)

    def stop_for_shutdown(self, jobs: Sequence[JobDir]) -> list[str]:
        """Nothing: SLURM jobs run on the cluster, independent of the control plane, which re-adopts them."""
        return []

    def admit(self) -> list[str]:
        """Nothing: SLURM queues jobs itself (they wait PENDING in squeue)."""
        return []

    def logs(self, job: JobDir) -> str:
        return read_logs(job)
