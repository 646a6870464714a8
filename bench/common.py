"""Shared pieces of the benchmarks: free ports, server subprocesses, result merging. Not tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "build" / "bench" / "results.json"

# Same engine settings for every side of a comparison (in-process engine, fp32, 1 GiB KV cache).
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def merge_results(figures: dict) -> None:
    """Merge `figures` into build/bench/results.json (other benchmarks own other keys)."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data.update(figures)
    RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def drop_weights(work: Path) -> None:
    """Delete the checkpoints and trainer states (and TRL's output folders) a benchmark's jobs left under `work`;
    logs, metrics and results stay. An RL session publishes every step: one bench.grpo_learn run left 11 GB."""
    doomed = [p for p in work.rglob("*") if p.is_dir() and (p.name in ("checkpoints", "state") or
                                                             p.name.startswith("out-trl"))]  # fmt: skip
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def rss_mb(pid: int) -> float:
    """Resident memory of one process, in MB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Process:
    """A server subprocess that is stopped with SIGTERM (then SIGKILL) when the block ends."""

    def __init__(self, argv: list[str], health_url: str, env: dict[str, str] | None = None, log: Path | None = None):
        self.argv, self.health_url = argv, health_url
        self.env = {**os.environ, **ENGINE_ENV, **(env or {})}
        self.log = log

    def __enter__(self) -> "Process":
        out = open(self.log, "w") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"{self.argv[:4]} exited with {self.proc.returncode}; see {self.log}")
            try:
                r = httpx.get(self.health_url, timeout=2)
                # vLLM's /health answers 200 with an empty body; ours answers {"all": "up", ...}.
                if r.status_code == 200 and (not r.content or r.json().get("all") == "up"):
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise TimeoutError(f"{self.health_url} not healthy after 300 s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def python() -> str:
    return sys.executable
