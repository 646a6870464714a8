"""The chart's SLURM entrypoints for real: slurmctld.sh and slurmd.sh start munged from a mounted key,
render the same slurm.conf from the environment the chart sets, exec their daemon, and run a job.

Each "pod" gets its own munge and config directories, as in Kubernetes; only the key is shared.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[3]
ENTRYPOINTS = REPO / "infra" / "entrypoints"


def _pod_env(tmp: Path, pod: str, port: int) -> dict[str, str]:
    """What the chart's slurm ConfigMap and pod spec set, with paths under `tmp/<pod>` instead of /etc, /run."""
    return {
        **os.environ,
        "SCALARLM_INFRA": str(REPO / "infra"),
        "MUNGE_KEY_SOURCE": str(tmp / "secret" / "munge.key"),
        "MUNGE_DIR": str(tmp / pod / "munge"),
        "MUNGE_SOCKET": str(tmp / pod / "munge" / "munge.socket.2"),
        "SLURM_CONF_DIR": str(tmp / pod / "etc"),
        "SLURM_CLUSTER_NAME": "entry",
        "SLURM_CONTROLLER_HOST": "localhost",
        "SLURM_CONTROLLER_ADDR": "127.0.0.1",
        "SLURM_CTLD_PORT": str(port),
        "SLURM_SLURMD_PORT": str(port + 1),
        "SLURM_USER": subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip(),
        "SLURM_SLURMD_USER": subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip(),
        "SLURM_STATE_DIR": str(tmp / "shared" / "slurm" / "state"),
        "SLURM_SPOOL_DIR": str(tmp / pod / "spool"),
        "SLURM_RUN_DIR": str(tmp / pod / "run"),
        "SLURM_LOG_DIR": str(tmp / pod / "log"),
        "SLURM_PMIX_TMPDIR": str(tmp / pod / "pmix"),
        "SLURM_PARTITION": "train",
        "SLURM_KILL_WAIT": "5",
        "SLURM_DISCOVERY": "static",
        "SLURM_NODES": "localhost:127.0.0.1",
        "SLURM_NODE_CPUS": "1",
        "SLURM_NODE_MEMORY_MB": "1000",
        "SLURM_GPU_KIND": "none",
        "SLURMD_NODENAME": "localhost",
        "SLURMCTLD_WAIT_SECONDS": "60",
    }


def _stop(proc: subprocess.Popen, munged_pid_file: Path) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    if munged_pid_file.exists():
        pid = int(munged_pid_file.read_text().strip() or 0)
        if pid:
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass


@pytest.fixture
def entrypoint_cluster(slurm_installed, free_port_pair: int, tmp_path: Path) -> Iterator[dict[str, str]]:
    """slurmctld.sh and slurmd.sh running as two "pods"; yields the controller pod's environment."""
    (tmp_path / "secret").mkdir()
    key = tmp_path / "secret" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o440)
    ctld_env = _pod_env(tmp_path, "ctld", free_port_pair)
    slurmd_env = _pod_env(tmp_path, "slurmd", free_port_pair)
    logs = {name: open(tmp_path / f"{name}.out", "w") for name in ("ctld", "slurmd")}
    ctld = subprocess.Popen(["bash", str(ENTRYPOINTS / "slurmctld.sh")], env=ctld_env, stdout=logs["ctld"],
                            stderr=subprocess.STDOUT)  # fmt: skip
    slurmd = subprocess.Popen(["bash", str(ENTRYPOINTS / "slurmd.sh")], env=slurmd_env, stdout=logs["slurmd"],
                              stderr=subprocess.STDOUT)  # fmt: skip
    try:
        client_env = {**ctld_env, "SLURM_CONF": str(tmp_path / "ctld" / "etc" / "slurm.conf")}
        deadline = time.monotonic() + 90
        state = ""
        while time.monotonic() < deadline and state != "idle":
            if ctld.poll() is not None or slurmd.poll() is not None:
                break
            done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=client_env, capture_output=True, text=True)
            state = done.stdout.strip()
            time.sleep(0.3)
        if state != "idle":
            outputs = {n: (tmp_path / f"{n}.out").read_text() for n in logs}
            pytest.fail(f"entrypoint cluster not idle ({state!r}): {outputs}")
        yield client_env
    finally:
        _stop(slurmd, tmp_path / "slurmd" / "munge" / "munged.pid")
        _stop(ctld, tmp_path / "ctld" / "munge" / "munged.pid")
        for f in logs.values():
            f.close()


def test_entrypoints_start_an_authenticated_cluster_that_runs_jobs(entrypoint_cluster, tmp_path):
    env = entrypoint_cluster
    conf = Path(env["SLURM_CONF"]).read_text()
    assert "AuthType=auth/munge" in conf and "NodeName=localhost NodeAddr=127.0.0.1" in conf
    # Each pod rendered its own copy from the same settings; only its local paths differ.
    other = (tmp_path / "slurmd" / "etc" / "slurm.conf").read_text()
    assert other.replace("/slurmd/", "/ctld/") == conf

    out = tmp_path / "job.out"
    job = subprocess.run(["sbatch", "--parsable", "-o", str(out), "--wrap", "srun hostname >/dev/null && echo ok"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    deadline = time.monotonic() + 60
    state = ""
    while time.monotonic() < deadline:
        done = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True)
        state = next((f.split("=", 1)[1] for f in done.stdout.split() if f.startswith("JobState=")), "")
        if state in {"COMPLETED", "FAILED", "CANCELLED"}:
            break
        time.sleep(0.3)
    assert state == "COMPLETED", (state, out.read_text() if out.exists() else "")
    assert out.read_text().strip() == "ok"


def test_a_wrong_munge_key_is_rejected(entrypoint_cluster, tmp_path):
    """A client whose munged has another key cannot talk to the controller: authentication is real."""
    intruder = tmp_path / "intruder"
    intruder.mkdir()
    (intruder / "munge.key").write_bytes(os.urandom(1024))
    (intruder / "munge.key").chmod(0o400)
    socket = intruder / "munge.socket.2"
    subprocess.run(["munged", "--force", f"--key-file={intruder / 'munge.key'}", f"--socket={socket}",
                    f"--pid-file={intruder / 'munged.pid'}", f"--log-file={intruder / 'munged.log'}",
                    f"--seed-file={intruder / 'munged.seed'}"], check=True)  # fmt: skip
    try:
        conf = Path(entrypoint_cluster["SLURM_CONF"]).read_text()
        bad_conf = intruder / "slurm.conf"
        bad_conf.write_text(conf.replace(entrypoint_cluster["MUNGE_SOCKET"], str(socket)))
        done = subprocess.run(["sinfo", "-h"], env={**entrypoint_cluster, "SLURM_CONF": str(bad_conf)},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode != 0 and not done.stdout
        ctld_log = (tmp_path / "ctld" / "log" / "slurmctld.log").read_text()
        assert "Munge decode failed" in ctld_log or "auth_g_verify" in ctld_log, ctld_log[-2000:]
    finally:
        os.kill(int((intruder / "munged.pid").read_text().strip()), 15)
