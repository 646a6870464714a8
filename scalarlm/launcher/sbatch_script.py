"""The sbatch script a SLURM job runs: resources from the train args, then the trainer under `srun --mpi=none`."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from string import Template

from scalarlm.config import Settings
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import TrainJobConfig

# The notify URL and key reach the ranks through sbatch's own environment, so the key is in no file.
NOTIFY_NOTE = (
    "# SCALARLM_NOTIFY_URL and SCALARLM_NOTIFY_KEY (the control plane's internal key, valid only for announcing\n"
    "# published steps) come from sbatch's environment (--export=ALL); the key is deliberately not in this file."
)
NO_NOTIFY_NOTE = "# the trainer announces no steps (no notify URL is known); the catalog's file poll finds them"

# --no-requeue: a job whose node fails ends NODE_FAIL instead of SLURM silently restarting it; the control plane then
# marks it FAILED with that reason or resumes it from its saved state, as `training.resume` says.
# Seconds before the time limit at which SLURM sends SIGTERM so the trainer saves its state.
SIGNAL_LEAD_SECONDS = 120
# Who gets that SIGTERM. Under srun, the ranks' step itself (sbatch's --signal without B:): srun answers a SIGTERM
# of its own by SIGKILLing every rank, so nothing would be saved. Under mpirun (inside the batch step), the batch
# shell, which passes it to mpirun.
FORWARD_TERM = """
# --signal=B:TERM reaches only this shell: pass it on so every rank checkpoints before the limit.
forward_term() { kill -TERM "$child" 2>/dev/null; }
trap forward_term TERM
"""

SBATCH_TEMPLATE = Template(
    """#!/bin/bash
#SBATCH --job-name=scalarlm-${job_id}
#SBATCH --nodes=${nodes}
${task_lines}
#SBATCH --time=${minutes}
#SBATCH --signal=${signal}
#SBATCH --output=${log}
#SBATCH --open-mode=append
#SBATCH --chdir=${chdir}
#SBATCH --export=ALL
#SBATCH --no-requeue
${options}# scalarlm job ${job_id}: ${ranks} ranks, tensor_parallel_size=${tp}, data_parallel_size=${dp}
${notify_note}

set -u
# The first node's address as SLURM knows it (NodeAddr): its name may not resolve on the other nodes.
first="$$(scontrol show hostnames "$$SLURM_JOB_NODELIST" | head -n 1)"
addr="$$(scontrol -o show node "$$first" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)"
export MASTER_ADDR="$${addr:-$$first}"
# A port free on this host, the first node, where rank 0 listens (one picked on the control plane's host may be
# taken here, e.g. by another job's rendezvous on the same node).
MASTER_PORT="$$(${python} -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')" ||
    exit 1
export MASTER_PORT
# srun (SLURM >= 22.05) no longer takes --cpus-per-task from the allocation: pass the sbatch option on to the ranks.
if [ -n "$${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$$SLURM_CPUS_PER_TASK"; fi
export PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
${forward}
${launch} ${trainer} &
child=$$!
wait "$$child"
rc=$$?
# `wait` returns early when a trap fires; keep waiting for the ranks to finish saving.
while kill -0 "$$child" 2>/dev/null; do
    wait "$$child"
    rc=$$?
done
exit $$rc
"""
)


@dataclass(frozen=True)
class Resources:
    """What the job asks SLURM for."""

    nodes: int
    ranks: int
    gpus_per_node: int
    tasks_per_node: int | None
    minutes: int


def resources(config: TrainJobConfig, settings: Settings) -> Resources:
    """Nodes, ranks, GPUs per node and a whole-minute time limit for `config`; InvalidRequest if they cannot fit."""
    args = config.train_args
    limit = settings.training.gpus_per_node
    if args.gpus and limit and args.gpus > limit:
        raise InvalidRequest(f"gpus {args.gpus} exceeds the {limit} GPUs of a node", param="gpus")
    if args.gpus and args.gpus % args.tensor_parallel_size:  # ranks fill nodes in order: a group would straddle two
        raise InvalidRequest(
            f"tensor_parallel_size {args.tensor_parallel_size} must fit in one node's {args.gpus} GPUs and divide them "
            "(each tensor-parallel group stays within a node)",
            param="tensor_parallel_size",
        )
    seconds = min(args.timeout, settings.training.max_train_seconds) + SIGNAL_LEAD_SECONDS + 60
    return Resources(
        nodes=args.nodes,
        ranks=args.world_size,
        gpus_per_node=args.gpus,
        tasks_per_node=args.gpus or None,
        minutes=math.ceil(seconds / 60),
    )


def render_sbatch(
    config: TrainJobConfig, settings: Settings, *, job_root: str, log: str, python: str,
    entry: list[str], launch: str = "srun", notify: bool = False,
) -> str:  # fmt: skip
    """The sbatch script text; `launch` is 'srun' (one task per rank) or 'mpirun' (inside the batch step).

    `notify`: sbatch's environment holds SCALARLM_NOTIFY_URL/KEY (see SlurmLauncher.sbatch_environment); srun
    passes them on by itself, mpirun is told to. The key is never written into the script.
    """
    res = resources(config, settings)
    if res.gpus_per_node:
        task_lines = f"#SBATCH --ntasks-per-node={res.tasks_per_node}\n#SBATCH --gres=gpu:{res.gpus_per_node}"
    else:
        task_lines = f"#SBATCH --ntasks={res.ranks}"
    if launch == "srun":
        # srun names each task by SLURM_* variables; the trainer reads torchrun's names when not under mpirun
        # (LOCAL_WORLD_SIZE: the ranks sharing a node's cores; a CPU job's --ntasks spread in blocks over its nodes).
        local = res.tasks_per_node or math.ceil(res.ranks / res.nodes)
        launcher = (  # --mpi=none: the ranks rendezvous by torch.distributed, and need no PMI plugin on the cluster
            "srun --mpi=none --kill-on-bad-exit=1 bash -c "
            "'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID "
            f"LOCAL_WORLD_SIZE={local}; exec \"$@\"' rank"
        )
    elif launch == "mpirun":
        launcher = f"mpirun -n {res.ranks} --bind-to none -x MASTER_ADDR -x MASTER_PORT"
        if notify:
            launcher += " -x SCALARLM_NOTIFY_URL -x SCALARLM_NOTIFY_KEY"
    else:
        raise ValueError(f"launch must be 'srun' or 'mpirun', not {launch!r}")
    tp = config.train_args.tensor_parallel_size
    return SBATCH_TEMPLATE.substitute(
        job_id=config.job_id,
        nodes=res.nodes,
        task_lines=task_lines,
        minutes=res.minutes,
        signal=f"TERM@{SIGNAL_LEAD_SECONDS}" if launch == "srun" else f"B:TERM@{SIGNAL_LEAD_SECONDS}",
        forward="" if launch == "srun" else FORWARD_TERM,
        log=shlex.quote(log),
        chdir=shlex.quote(job_root),
        ranks=res.ranks,
        tp=tp,
        dp=res.ranks // tp,
        python=shlex.quote(python),
        launch=launcher,
        trainer=shlex.join([python, *entry, job_root]),
        notify_note=NOTIFY_NOTE if notify else NO_NOTIFY_NOTE,
        options="".join(f"#SBATCH {option}\n" for option in settings.training.sbatch_options),
    )
