"""`scalarlm serve` subprocesses on loopback for the security tests, and their memory from /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, log: Path, need_engine: bool, timeout: float = 600.0) -> None:
    """Wait until /v1/health answers (and the engine is up when `need_engine`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"scalarlm serve exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            health = httpx.get(f"{url}/v1/health", timeout=5).json()
            if health.get("all" if need_engine else "api") == "up":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    pytest.fail(f"scalarlm serve not up after {timeout} s:\n{log.read_text()[-6000:]}")


@contextmanager
def serve(args: list[str], home: Path, env: dict[str, str] | None = None, need_engine: bool = False,
          stop: bool = True) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """Run `scalarlm serve <args>` on a free loopback port; yields (url, process, log path)."""
    port = free_port()
    log = home.parent / f"serve-{port}.log"
    command = [sys.executable, "-m", "scalarlm.cli", "serve", *args, "--home", str(home),
               "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, log, need_engine)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def job_status(url: str, job_id: str) -> dict:
    """GET /v1/megatron/train/<job_id>: the job's status, config and checkpoints."""
    return httpx.get(f"{url}/v1/megatron/train/{job_id}", timeout=30).json()


def wait_job(url: str, job_id: str, until, timeout: float = 420.0) -> dict:
    """Poll the job until `until(body)` holds; fail with the job's logs after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        body = job_status(url, job_id)
        if until(body):
            return body
        if time.monotonic() > deadline:
            logs = httpx.get(f"{url}/v1/megatron/train/{job_id}/logs", timeout=30).text
            pytest.fail(f"job {job_id}: {body['job_status']} after {timeout}s\n{logs[-3000:]}")
        time.sleep(0.5)
