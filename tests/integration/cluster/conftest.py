"""A split cluster for real: `scalarlm serve --role api` and two `--role worker` processes, each on its own host
(network namespace), started through the CLI as the Helm entrypoints start them, sharing only the home
directory; the client runs on a fourth host. API keys come from a file, workers use the worker key on the shared
volume. Leases are short (5 s) so a lost worker's items come back within a test.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_roles import API_KEY, Cluster
from netns_hosts import Hosts, netns_available, shared_home


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = netns_available()
    if reason is not None:
        pytest.skip(f"cannot create network namespaces: {reason}")
    root = tmp_path_factory.mktemp("cluster")
    (root / "keys.txt").write_text(f"{API_KEY}\n")
    (root / "api.yaml").write_text("generate:\n  lease_seconds: 5\n")
    hosts = Hosts.create(["api", "w1", "w2", "client"])
    cluster = Cluster(hosts=hosts, home=shared_home(root), root=root, model=tiny_model_dir)
    try:
        for name in ("api", "w1", "w2"):
            cluster.start(name)
        cluster.wait_up("api", "w1", "w2")
        yield cluster
    finally:
        for proc in cluster.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in cluster.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        hosts.remove()
