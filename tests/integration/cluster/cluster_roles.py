"""The roles of the namespaced split cluster (see conftest.py): start, kill, read the shared queue, run the client.

A helper module with a name unique in the suite, imported by conftest.py and the cluster tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from netns_hosts import Hosts, shared_home

from scalarlm.checkpoint import JobDir
from scalarlm.protocol.training import JobStatus

HERE = Path(__file__).parent
API_KEY = "cluster-operator-key"
PORT, WORKER_PORT = 8000, 8001


@dataclass
class Cluster:
    """The running roles: processes by name, the hosts, the shared home, and the logs."""

    hosts: Hosts
    home: Path
    root: Path
    model: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return f"http://{self.hosts['api'].address}:{PORT}"

    def worker_url(self, name: str) -> str:
        return f"http://{self.hosts[name].address}:{WORKER_PORT}"

    def start(self, name: str) -> subprocess.Popen:
        """Start role `name` (api, w1, w2) on its host with the CLI; replaces a dead process of that name."""
        host = self.hosts[name]
        serve = [sys.executable, "-m", "scalarlm.cli", "serve", "--model", str(self.model), "--home", str(self.home),
                 "--host", host.address]  # fmt: skip
        if name == "api":
            argv = [*serve, "--role", "api", "--port", str(PORT), "--config", str(self.root / "api.yaml"),
                    "--worker-url", self.worker_url("w1"), "--worker-url", self.worker_url("w2")]  # fmt: skip
        else:
            argv = [*serve, "--role", "worker", "--port", str(WORKER_PORT), "--api-url", self.api_url]
        env = {**os.environ, "SCALARLM_API_KEYS_FILE": str(self.root / "keys.txt"), "PYTHONUNBUFFERED": "1"}
        log = open(self.root / f"{name}.log", "ab")
        proc = subprocess.Popen(host.command(*argv), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def kill(self, name: str) -> int:
        """SIGKILL role `name` and every process under it (a lost host loses them all: a worker's vLLM EngineCore
        child would otherwise live on, orphaned, holding its memory); its pid."""
        proc = self.procs[name]
        kill_tree(proc.pid)
        proc.wait(timeout=30)
        return proc.pid

    def job(self, job_id: str) -> JobDir:
        """A training job's directory on the shared volume."""
        return JobDir(self.home / "jobs" / job_id)

    def wait_job(self, job_id: str, until: Callable[[JobStatus], bool], timeout: float = 300.0) -> JobStatus:
        """Poll the job's status file (as an operator would) until `until(status)`."""
        deadline = time.monotonic() + timeout
        while not until(status := self.job(job_id).read_status()):
            assert time.monotonic() < deadline, f"job {job_id}: {status}\n{self.logs()}"
            time.sleep(0.5)
        return status

    def client(self, *args: str, background: bool = False) -> subprocess.Popen | dict:
        """Run cluster_client.py on the client host; its RESULT (or the running process when `background`)."""
        command = self.hosts["client"].command(sys.executable, str(HERE / "cluster_client.py"), *args)
        env = {**os.environ, "SCALARLM_API_KEY": API_KEY}
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        return proc if background else result_of(proc)

    def wait_up(self, *names: str) -> None:
        urls = [f"{self.api_url}/v1/health" if n == "api" else f"{self.worker_url(n)}/health" for n in names]
        assert self.client("wait", *urls) == {"up": True}, self.logs()

    def completed(self) -> int:
        """Items completed in the shared queue (read from the file, as an operator would)."""
        with contextlib.closing(sqlite3.connect(f"file:{self.home / 'queue.sqlite'}?mode=ro", uri=True)) as db:
            return db.execute("SELECT count(*) FROM items WHERE state = 'completed'").fetchone()[0]

    def finishers(self, since: float) -> dict[str, int]:
        """Items completed after `since` (epoch seconds), by the worker id that finished them."""
        with contextlib.closing(sqlite3.connect(f"file:{self.home / 'queue.sqlite'}?mode=ro", uri=True)) as db:
            rows = db.execute("SELECT worker_id, count(*) FROM items WHERE state = 'completed' AND finished > ? "
                              "GROUP BY worker_id", (since,)).fetchall()  # fmt: skip
        return dict(rows)

    def wait_completed(self, count: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while self.completed() < count:
            assert time.monotonic() < deadline, f"fewer than {count} completed\n{self.logs()}"
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in self.root.glob("*.log"))


def result_of(proc: subprocess.Popen, timeout: float = 900.0) -> dict:
    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"client exited {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything under it, as losing its host would."""
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found through /proc's parent ids)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker_id(pid: int) -> str:
    """The id a worker process reports (inference.worker.default_worker_id: host name and pid)."""
    return f"{socket.gethostname()}-{pid}"


@contextlib.contextmanager
def running_cluster(model: Path, root: Path) -> Iterator[Cluster]:
    """API, w1 and w2 up on their hosts (plus a client host), 5 s leases, keys from a file under `root`, trainers run
    by the API's local launcher (crashed ones resumed once); every role
    stopped and every namespace removed at the end. Used by the cluster tests and bench/scale_out.py."""
    (root / "keys.txt").write_text(f"{API_KEY}\n")
    # Crashed trainers are relaunched from their saved state once, then reported FAILED.
    (root / "api.yaml").write_text("generate:\n  lease_seconds: 5\n"
                                   "training:\n  poll_seconds: 1\n  resume: all\n  max_resumes: 1\n")  # fmt: skip
    hosts = Hosts.create(["api", "w1", "w2", "client"])
    cluster = Cluster(hosts=hosts, home=shared_home(root), root=root, model=model)
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
