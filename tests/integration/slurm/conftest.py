"""A real one-node SLURM cluster (munge auth, loopback) for the `slurm` tests, started once per session.

The fixture installs the Debian packages when they are missing (as root), starts the daemons with
`infra/slurm/local-cluster.sh` in a scratch directory, and stops exactly those daemons at teardown.
Without root and without SLURM installed, the tests skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LOCAL_CLUSTER = REPO / "infra" / "slurm" / "local-cluster.sh"
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
COMMANDS = ["slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "sacct", "munged"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


@dataclass(frozen=True)
class SlurmCluster:
    """Where the running test cluster lives: its config file and scratch directory."""

    conf: Path
    base: Path

    def env(self) -> dict[str, str]:
        """The environment a SLURM client command needs to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, timeout: float = 30) -> str:
        """Run a SLURM client command against this cluster and return its stdout."""
        done = subprocess.run(args, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def job_state(self, job_id: str) -> str:
        """The job's state: `scontrol show job` while SLURM remembers it, else the jobcomp file (`sacct -c`)."""
        try:
            out = self.run("scontrol", "-o", "show", "job", job_id)
        except RuntimeError:
            out = ""
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        rows = self.run("sacct", "-c", "-n", "-P", "-j", job_id, "-o", "JobID,State").splitlines()
        for row in rows:
            jid, _, state = row.partition("|")
            if jid == job_id:
                return state.split()[0]
        return "UNKNOWN"

    def wait_state(self, job_id: str, wanted: set[str], timeout: float = 60) -> str:
        """Poll until the job reaches one of `wanted` (or any final state); fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in wanted or state in TERMINAL:
                return state
            time.sleep(0.2)
        pytest.fail(f"job {job_id} still {state} after {timeout}s; slurmctld log: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        """The end of slurmctld's log, for failure messages."""
        log = self.base / "log" / "slurmctld.log"
        return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else "(no log)"


def _missing() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]


def _install_or_skip() -> None:
    """Install SLURM and munge from Debian when missing; skip when that is impossible (not root)."""
    missing = _missing()
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing) and installing it needs root")
    if shutil.which("apt-get") is None:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing) and there is no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, capture_output=True, timeout=300)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
        env=env, check=True, capture_output=True, timeout=600,
    )
    if _missing():
        pytest.fail(f"apt-get installed {PACKAGES} but {_missing()} are still missing")


def _free_port_pair() -> int:
    """A port p with p and p+1 both free on loopback (slurmctld and slurmd), so parallel runs never clash."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


@pytest.fixture(scope="session")
def slurm_installed() -> None:
    """SLURM and munge are installed (installed now if missing and root; else the test skips)."""
    _install_or_skip()


@pytest.fixture(scope="session")
def free_port_pair() -> int:
    """A port p with p and p+1 free on loopback."""
    return _free_port_pair()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Start a one-node SLURM cluster for the session (tests pass `cluster.env()` or set SLURM_CONF themselves)."""
    _install_or_skip()
    base = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_PORT_BASE": str(_free_port_pair())}
    started = subprocess.run(
        ["bash", str(LOCAL_CLUSTER), "start", str(base)], env=env, capture_output=True, text=True, timeout=120
    )
    if started.returncode:
        pytest.fail(f"the SLURM test cluster did not start:\n{started.stdout}\n{started.stderr}")
    try:
        yield SlurmCluster(conf=base / "etc" / "slurm.conf", base=base)
    finally:
        subprocess.run(["bash", str(LOCAL_CLUSTER), "stop", str(base)], capture_output=True, timeout=120)
