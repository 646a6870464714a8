"""The sbatch script SlurmLauncher submits: resources from gpus/nodes/TP, signal before the limit, srun --mpi=none."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys

import pytest

from scalarlm.config import Settings
from scalarlm.launcher import SlurmLauncher
from scalarlm.protocol.errors import InvalidRequest


def directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --") :].partition("=")
            out[key] = value
    return out


def test_gpu_job_asks_for_gpus_per_node_on_every_node(settings, new_job):
    job, config = new_job(gpus=4, nodes=2, tensor_parallel_size=2, timeout=3600)
    script = SlurmLauncher(settings).script(job, config)

    d = directives(script)
    assert d["nodes"] == "2"
    assert d["ntasks-per-node"] == "4"
    assert d["gres"] == "gpu:4"
    assert d["signal"] == "TERM@120"  # to the ranks' step: srun would answer a TERM of its own with SIGKILL
    assert d["time"] == str((3600 + 120 + 60) // 60)  # room for the final checkpoint after the signal
    assert d["output"] == str(job.logs_dir / "launcher.log")
    assert "8 ranks, tensor_parallel_size=2, data_parallel_size=4" in script
    assert "srun --mpi=none --kill-on-bad-exit=1 bash -c 'export RANK=$SLURM_PROCID" in script
    # each task's torchrun names, as srun's environment gives them (LOCAL_WORLD_SIZE: the ranks on its node)
    words = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    wrapper = words[words.index("-c") + 1]
    task = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "PATH": "/usr/bin:/bin"}
    shell = subprocess.run(["bash", "-c", wrapper, "rank", "env"], env=task, capture_output=True, text=True)
    names = dict(line.split("=", 1) for line in shell.stdout.splitlines())
    assert [names[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")] == ["5", "8", "1", "4"]
    assert f"exec \"$@\"' rank {sys.executable} -m scalarlm.training {job.root}" in script
    assert "trap forward_term TERM" not in script
    assert "grep -o 'NodeAddr=[^ ]*'" in script  # MASTER_ADDR: the first node's address, not only its name


def test_the_rendezvous_port_is_one_free_on_the_first_node(settings, new_job, tmp_path):
    """Picked when the batch script runs (on the first node, where rank 0 listens), not on the control plane."""
    job, config = new_job(gpus=0, cpu_ranks=2)
    script = SlurmLauncher(settings).script(job, config)
    start, end = script.index("\nMASTER_PORT="), script.index("export PYTHONUNBUFFERED")
    shell = subprocess.run(["bash", "-c", script[start:end] + 'echo "$MASTER_PORT"'], capture_output=True, text=True)
    port = int(shell.stdout)
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free here


def test_cpu_job_asks_for_tasks_and_no_gpus(settings, new_job):
    job, config = new_job(cpu_ranks=2)
    d = directives(SlurmLauncher(settings).script(job, config))
    assert d["ntasks"] == "2"
    assert "gres" not in d and "ntasks-per-node" not in d


def test_time_limit_is_capped_by_the_server_setting(tmp_path, new_job):
    settings = Settings(home=tmp_path / "home", training={"max_train_seconds": 600})
    job, config = new_job(timeout=10 * 3600)
    assert directives(SlurmLauncher(settings).script(job, config))["time"] == str((600 + 180) // 60)


def test_mpirun_inside_the_allocation(settings, new_job):
    job, config = new_job(cpu_ranks=2)
    script = SlurmLauncher(settings, launch="mpirun").script(job, config)
    assert "mpirun -n 2 --bind-to none -x MASTER_ADDR -x MASTER_PORT" in script
    assert directives(script)["signal"] == "B:TERM@120" and "trap forward_term TERM" in script  # the ranks: mpirun's
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in script


def test_tensor_parallel_group_must_fit_in_a_node(settings, new_job):
    job, config = new_job(gpus=2, nodes=2, tensor_parallel_size=4)
    with pytest.raises(InvalidRequest, match="tensor_parallel_size 4"):
        SlurmLauncher(settings).script(job, config)
    # 3 GPUs a node, TP=2: ranks 2 and 3 would form a group across the two nodes
    job, config = new_job(gpus=3, nodes=2, tensor_parallel_size=2)
    with pytest.raises(InvalidRequest, match="tensor_parallel_size 2 must fit in one node's 3 GPUs and divide them"):
        SlurmLauncher(settings).script(job, config)


def test_gpus_beyond_a_node_are_refused(tmp_path, new_job):
    settings = Settings(home=tmp_path / "home", training={"gpus_per_node": 8})
    job, config = new_job(gpus=16)
    with pytest.raises(InvalidRequest, match="gpus 16"):
        SlurmLauncher(settings).script(job, config)


def test_script_is_valid_bash(settings, new_job, tmp_path):
    job, config = new_job(gpus=8, nodes=4, tensor_parallel_size=8)
    path = tmp_path / "sbatch.sh"
    path.write_text(SlurmLauncher(settings).script(job, config))
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_the_clusters_own_options_are_lines_of_every_jobs_script(tmp_path, new_job):
    options = ["--partition=gpu", "--account=ml", "--cpus-per-task=12", "--mem=0", "--constraint h100"]
    settings = Settings(home=tmp_path / "home", training={"sbatch_options": options})
    job, config = new_job(gpus=8, nodes=2)
    script = SlurmLauncher(settings).script(job, config)
    d = directives(script)
    assert (d["partition"], d["account"], d["cpus-per-task"], d["mem"]) == ("gpu", "ml", "12", "0")
    assert "#SBATCH --constraint h100\n" in script
    assert d["nodes"] == "2" and d["gres"] == "gpu:8"  # the job's own still there
    # before the first command: sbatch reads #SBATCH lines only up to it
    first_command = script.index("\nset -u")
    assert all(script.index(f"#SBATCH {o}") < first_command for o in options)
    # srun (SLURM >= 22.05) takes --cpus-per-task from SRUN_CPUS_PER_TASK only: the script passes the option on
    start, end = script.index("\nif [ -n \"${SLURM_CPUS_PER_TASK"), script.index("export PYTHONUNBUFFERED")
    shell = subprocess.run(["bash", "-c", "set -u" + script[start:end] + 'echo "${SRUN_CPUS_PER_TASK:-unset}"'],
                           env={"SLURM_CPUS_PER_TASK": "12", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert shell.stdout.strip() == "12", shell.stderr
    path = tmp_path / "sbatch.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


@pytest.mark.parametrize("option, refused", [("--ntasks=4", "--ntasks is set from each job"),
                                             ("-N2", "-N is set from each job"), ("--time 60", "--time is set"),
                                             ("--gres=gpu:a100:8", "--gres is set"), ("partition=gpu", "one option"),
                                             ("--comment=a\n#SBATCH --nodes=9", "one option on one line"),
                                             ("--sig=TERM@5", "--sig is set"),  # sbatch reads it as --signal
                                             ("--wait", "would keep the launcher from tracking it"),
                                             ("-H", "-H is set"), ("--distribution=cyclic", "--distribution")])
def test_an_option_the_job_sets_or_a_malformed_one_is_refused_at_startup(tmp_path, option, refused):
    with pytest.raises(ValueError, match=refused):
        Settings(home=tmp_path / "home", training={"sbatch_options": [option]})
