"""A split cluster for real: `scalarlm serve --role api` and two `--role worker` processes, each on its own host
(network namespace), started through the CLI as the Helm entrypoints start them, sharing only the home
directory; the client runs on a fourth host. API keys come from a file, workers use the worker key on the shared
volume. Leases are short (5 s) so a lost worker's items come back within a test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_roles import Cluster, running_cluster
from netns_hosts import netns_available


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = netns_available()
    if reason is not None:
        pytest.skip(f"cannot create network namespaces: {reason}")
    with running_cluster(tiny_model_dir, tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster
