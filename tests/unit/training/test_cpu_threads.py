"""A CPU rank's threads: OMP_NUM_THREADS when set, else the control plane's counts, else the host's cores ÷ ranks;
a session step that overlaps generation takes its own count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scalarlm.config import host_cores
from scalarlm.training.launch_env import LaunchEnv
from scalarlm.training.parallel import Parallel, cpu_thread_counts


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_control_planes_counts_win_over_the_share_and_omp_num_threads_over_both():
    cores = host_cores()
    assert cpu_thread_counts(LaunchEnv()) == (cores, cores)
    assert cpu_thread_counts(LaunchEnv(local_world_size=2)) == (max(1, cores // 2),) * 2
    assert cpu_thread_counts(LaunchEnv(), None, 1) == (cores, 1)
    assert cpu_thread_counts(LaunchEnv(), 3, 1) == (3, 1)
    assert cpu_thread_counts(LaunchEnv(omp_threads=2), 3, 1) == (2, 2)


def test_a_step_runs_on_the_count_for_its_overlap_and_a_gpu_rank_keeps_its_threads():
    cpu = Parallel(rank=0, world_size=1, device=torch.device("cpu"), tp_size=1, tp_rank=0, dp_size=1, dp_rank=0,
                   tp_group=None, dp_group=None, cpu_threads=(2, 1))  # fmt: skip
    assert cpu.use_cpu_threads(overlapped=True) == torch.get_num_threads() == 1
    assert cpu.use_cpu_threads(overlapped=False) == torch.get_num_threads() == 2
    torch.set_num_threads(3)
    gpu = dataclasses.replace(cpu, device=torch.device("cuda", 0), cpu_threads=(0, 0))
    assert gpu.use_cpu_threads(overlapped=True) == 0 and torch.get_num_threads() == 3
