"""A CPU rank's threads: OMP_NUM_THREADS when set, else the control plane's count, else the host's cores ÷ ranks."""

from __future__ import annotations

import pytest
import torch

from scalarlm.config import host_cores
from scalarlm.training.launch_env import LaunchEnv
from scalarlm.training.parallel import set_cpu_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_control_planes_count_wins_over_the_share_and_omp_num_threads_over_both():
    assert set_cpu_threads(LaunchEnv(), None) == torch.get_num_threads() == host_cores()
    assert set_cpu_threads(LaunchEnv(local_world_size=2), None) == max(1, host_cores() // 2)
    assert set_cpu_threads(LaunchEnv(), 1) == torch.get_num_threads() == 1
    assert set_cpu_threads(LaunchEnv(omp_threads=2), 1) == torch.get_num_threads() == 2
