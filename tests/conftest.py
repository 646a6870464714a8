"""Fixtures shared by the whole suite. Nothing here downloads anything."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


REPO = Path(__file__).resolve().parents[1]
SDK_VENV = REPO / "build" / "venv-sdk"
SDK_PYTHON = SDK_VENV / "bin" / "python"
# ScalarLM's published SDK; matplotlib and humanize are only for its CLI, `import masint` needs these.
SDK_PACKAGES = ["aiohttp", "aiofiles", "jsonlines"]


def _sdk_ready() -> bool:
    return SDK_PYTHON.exists() and subprocess.run([SDK_PYTHON, "-c", "import masint"],
                                                  capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def sdk_python() -> Path:
    """A venv with ScalarLM's SDK 1.151, created once (idempotent)."""
    if _sdk_ready():
        return SDK_PYTHON
    steps = [
        [sys.executable, "-m", "venv", str(SDK_VENV)],
        [str(SDK_PYTHON), "-m", "pip", "install", "-q", "--no-deps", "scalarlm==1.151"],
        [str(SDK_PYTHON), "-m", "pip", "install", "-q", *SDK_PACKAGES],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"cannot build the SDK venv ({' '.join(step[-2:])}): {done.stderr[-500:]}")
    return SDK_PYTHON


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama model + tokenizer, built once per test session (a few seconds)."""
    from scalarlm.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@dataclass
class ServeLaunch:
    """A `scalarlm serve` process started by `launch_serve`, not yet known to be up."""

    proc: subprocess.Popen
    url: str
    home: Path
    log: Path


def launch_serve(tmp: Path, model: Path, env: dict[str, str] | None = None) -> ServeLaunch:
    """Start a real `scalarlm serve` on a free port with its home under `tmp` (`wait_serving`, then `stop_serve`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp / "server.log"
    command = [sys.executable, "-m", "scalarlm.cli", "serve", "--model", str(model),
               "--home", str(tmp / "home"), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return ServeLaunch(proc, f"http://127.0.0.1:{port}", tmp / "home", log)


def wait_serving(launch: ServeLaunch) -> None:
    """Until `/v1/health` says every part is up; the test fails with the log if the server exits or takes 600 s."""
    deadline = time.monotonic() + 600
    while True:
        if launch.proc.poll() is not None:
            pytest.fail(f"scalarlm serve exited with {launch.proc.returncode}:\n{launch.log.read_text()[-6000:]}")
        try:
            if httpx.get(f"{launch.url}/v1/health", timeout=5).json().get("all") == "up":
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"scalarlm serve not up after 600 s:\n{launch.log.read_text()[-6000:]}")
        time.sleep(0.5)


def stop_serve(launch: ServeLaunch) -> None:
    """SIGTERM; the test fails (after a SIGKILL) if the server ignores it for 60 s."""
    launch.proc.send_signal(signal.SIGTERM)
    try:
        launch.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        launch.proc.kill()
        launch.proc.wait()
        pytest.fail(f"scalarlm serve ignored SIGTERM for 60 s:\n{launch.log.read_text()[-3000:]}")


@contextmanager
def start_serve(tmp: Path, model: Path, env: dict[str, str] | None = None) -> Iterator[tuple[str, Path, int]]:
    """A real `scalarlm serve` on a free port with its home under `tmp`: (URL, home, pid), stopped with SIGTERM."""
    launch = launch_serve(tmp, model, env)
    try:
        wait_serving(launch)
        yield launch.url, launch.home, launch.proc.pid
    finally:
        stop_serve(launch)


@dataclass(frozen=True)
class ServeSteps:
    """`scalarlm serve`'s start in three steps, for a fixture that boots the next server while tests use this one."""

    launch: Callable[..., ServeLaunch] = launch_serve
    wait: Callable[[ServeLaunch], None] = wait_serving
    stop: Callable[[ServeLaunch], None] = stop_serve


@pytest.fixture(scope="session")
def serve_steps() -> ServeSteps:
    """`launch_serve`, `wait_serving` and `stop_serve`."""
    return ServeSteps()


@pytest.fixture(scope="session")
def serve_process() -> Callable[..., contextlib.AbstractContextManager[tuple[str, Path, int]]]:
    """`with serve_process(tmp, model, env) as (url, home, pid)`: a real `scalarlm serve` for the block."""
    return start_serve


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(URL, home) of one real `scalarlm serve` of the tiny model with default settings (control plane, in-process
    vLLM worker, local trainer launcher), shared by the e2e and closed-loop tests: a boot costs about 45 s here.
    Its tests name the models they use (a job's own id, or the base before any job); none needs an empty server."""
    with start_serve(tmp_path_factory.mktemp("tiny-server"), tiny_model_dir) as (url, home, _):
        yield url, home


def _processes_mentioning(text: str) -> list[int]:
    """Pids (other than ours) whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_suite(tmp_path_factory: pytest.TempPathFactory):
    """Trainers and servers started by tests run in their own sessions by design (they survive a control-plane
    restart); at the end of the suite, stop whatever still runs on this run's temp directories."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    pids = _processes_mentioning(base)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 10
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
