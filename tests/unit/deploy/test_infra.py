"""infra/: SLURM config templates render to what a cluster needs, with munge auth and GPU GRES."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from deploy_files import CHART, INFRA, REPO

SCRIPTS = sorted(INFRA.rglob("*.sh"))


def _render(tmp_path: Path, **env: str) -> dict[str, str]:
    """Run render-conf.sh with `env` and return the files it wrote."""
    full = {"PATH": os.environ["PATH"], "SLURM_CONF_DIR": str(tmp_path), "SLURM_CONTROLLER_HOST": "ctl-0",
            "SLURM_DEV_DIR": str(tmp_path / "no-devices"), **env}
    subprocess.run(["bash", str(INFRA / "slurm" / "render-conf.sh")], env=full, check=True, capture_output=True,
                   timeout=60)
    return {name: (tmp_path / name).read_text() for name in ("slurm.conf", "gres.conf", "cgroup.conf")}


def test_no_auth_none_anywhere():
    roots = [INFRA, CHART, REPO / "Dockerfile.cuda", REPO / "Dockerfile.rocm"]
    files = [p for r in roots for p in ([r] if r.is_file() else r.rglob("*")) if p.is_file()]
    offenders = [str(p) for p in files if "auth/none" in p.read_text(errors="replace")]
    assert not offenders


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(INFRA)))
def test_shell_scripts_parse_and_are_executable(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(script, os.X_OK), f"{script} is not executable"


def test_static_nodes_render_with_munge_auth(tmp_path):
    out = _render(tmp_path, SLURM_NODES="n1:10.0.0.1 n2", SLURM_NODE_CPUS="16", SLURM_NODE_MEMORY_MB="64000")
    conf = out["slurm.conf"]
    assert "AuthType=auth/munge" in conf and "CredType=cred/munge" in conf
    assert "SlurmctldHost=ctl-0\n" in conf
    assert "NodeName=n1 NodeAddr=10.0.0.1 CPUs=16 RealMemory=64000 State=UNKNOWN" in conf
    assert "NodeName=n2 NodeAddr=n2 CPUs=16 RealMemory=64000 State=UNKNOWN" in conf
    assert "ProctrackType=proctrack/linuxproc" in conf and "${" not in conf
    assert "Name=gpu" not in out["gres.conf"]


def test_kubernetes_discovery_lists_statefulset_pods(tmp_path):
    out = _render(
        tmp_path, SLURM_CONTROLLER_ADDR="ctl-0.ctl.ml.svc.cluster.local", SLURMD_STATEFULSET="r-slurmd",
        SLURMD_SERVICE="r-slurmd", SLURMD_REPLICAS="3", POD_NAMESPACE="ml", DISCOVERY_WAIT_SECONDS="0",
        SLURM_NODE_GPUS="8", SLURM_GPU_KIND="nvidia",
    )
    conf = out["slurm.conf"]
    assert "SlurmctldHost=ctl-0(ctl-0.ctl.ml.svc.cluster.local)" in conf
    for i in range(3):
        assert f"NodeName=r-slurmd-{i} NodeAddr=r-slurmd-{i}.r-slurmd.ml.svc.cluster.local " in conf
    assert conf.count("Gres=gpu:8") == 3 and "GresTypes=gpu" in conf


@pytest.mark.parametrize(
    ("kind", "autodetect", "expected"),
    [
        ("nvidia", "no", "Name=gpu File=/dev/nvidia[0-7]"),
        ("nvidia", "yes", "AutoDetect=nvml"),
        ("amd", "no", "Name=gpu File=/dev/dri/renderD[128-135]"),
        ("amd", "yes", "AutoDetect=rsmi"),
    ],
)
def test_gres_for_nvidia_and_amd(tmp_path, kind, autodetect, expected):
    out = _render(tmp_path, SLURM_NODES="n1", SLURM_NODE_GPUS="8", SLURM_GPU_KIND=kind,
                  SLURM_GRES_AUTODETECT=autodetect)
    assert expected in out["gres.conf"]


def test_cgroup_conf_constrains_devices_for_proctrack_cgroup(tmp_path):
    out = _render(tmp_path, SLURM_NODES="n1", SLURM_PROCTRACK="proctrack/cgroup", SLURM_TASK_PLUGIN="task/cgroup")
    assert "ProctrackType=proctrack/cgroup" in out["slurm.conf"]
    assert "ConstrainDevices=yes" in out["cgroup.conf"]


def test_entrypoints_exist_for_every_role():
    for role in ("api", "worker", "slurmctld", "slurmd"):
        text = (INFRA / "entrypoints" / f"{role}.sh").read_text()
        assert "exec " in text, f"{role}.sh must exec its daemon (PID 1 gets the signals)"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a stand-in GPU device needs root")
def test_gres_lists_the_gpu_devices_a_pod_sees(tmp_path):
    devices = tmp_path / "dev" / "dri"
    devices.mkdir(parents=True)
    for minor in (130, 131):  # a pod that got two AMD GPUs sees only their render nodes
        subprocess.run(["mknod", str(devices / f"renderD{minor}"), "c", "1", "3"], check=True)
    out = _render(tmp_path, SLURM_NODES="n1", SLURM_NODE_GPUS="2", SLURM_GPU_KIND="amd",
                  SLURM_DEV_DIR=str(tmp_path / "dev"))
    assert f"Name=gpu File={devices}/renderD130\nName=gpu File={devices}/renderD131" in out["gres.conf"]


def test_pmix_client_dirs_stay_under_the_cluster_directory(tmp_path):
    """srun --mpi=pmix names its per-step dirs by uid and job id: under /tmp, clusters on one host collide."""
    _render(tmp_path, SLURM_NODES="n1", SLURM_PMIX_TMPDIR=str(tmp_path / "pmix"))
    assert (tmp_path / "mpi.conf").read_text() == f"PMIxCliTmpDirBase={tmp_path / 'pmix'}\n"
