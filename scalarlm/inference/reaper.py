"""The engine's processes do not outlive the process that started them.

vLLM's `AsyncLLM` runs its `EngineCore` (and, at tensor parallel > 1, its workers) in child processes that wait on
their sockets forever when the front end dies without shutting them down (SIGKILL, the OOM killer): they keep
their memory, GPU memory on a GPU node, and a restarted `scalarlm serve` then fails to fit its engine. A
reaper is a small watcher process started beside the engine: it is told the engine's processes, and when its
parent dies (or closes the pipe on a normal stop) it SIGTERMs the ones still running, then SIGKILLs them (at once
those that ignore SIGTERM).

Run as `python -m scalarlm.inference.reaper`: it imports nothing heavy (no torch, no vLLM).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
TERM_GRACE_SECONDS = 3.0


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def descendants(root: int) -> list[tuple[int, int]]:
    """(pid, start ticks) of every live process under `root` in `root`'s session (trainers, started in a session of
    their own, are not the engine's and are left out)."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[int, int]] = {}  # pid -> (session, start ticks)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if not fields or fields[0] in ("Z", "X"):
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        info[pid] = (int(fields[3]), int(fields[19]))
    session = os.getsid(root)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in info and info[pid][0] == session:
            found.append((pid, info[pid][1]))
            todo += children.get(pid, [])
    return found


def _alive(pid: int, ticks: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X") and int(fields[19]) == ticks


def ignores_sigterm(pid: int) -> bool:
    """Whether `pid` has SIGTERM ignored (`SigIgn` in /proc/<pid>/status), as multiprocessing's resource tracker,
    which vLLM's engine start leaves beside the engine core, always has."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "0")
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def _kill(pids: list[int], processes: dict[int, int]) -> None:
    for pid in pids:
        if _alive(pid, processes[pid]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def reap(processes: dict[int, int]) -> list[int]:
    """SIGTERM the listed processes still running (same start ticks: never a reused pid), SIGKILL those left after
    the grace period; return the pids signalled. A process that ignores SIGTERM gets SIGKILL at once: the grace
    period could only end in it."""
    live = [pid for pid, ticks in processes.items() if _alive(pid, ticks)]
    deaf = [pid for pid in live if ignores_sigterm(pid)]
    _kill(deaf, processes)
    termed = [pid for pid in live if pid not in deaf]
    for pid in termed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_SECONDS
    while time.monotonic() < deadline and any(_alive(pid, processes[pid]) for pid in termed):
        time.sleep(0.1)
    _kill(termed, processes)
    return live


def main() -> int:
    """Read "pid ticks" lines from stdin until the parent dies or closes stdin, then reap them."""
    parent = os.getppid()
    processes: dict[int, int] = {}
    stdin = sys.stdin.fileno()
    buffer = b""
    while os.getppid() == parent:
        if select.select([stdin], [], [], POLL_SECONDS)[0]:
            chunk = os.read(stdin, 65536)
            if not chunk:
                break  # a normal stop: the engine was shut down; kill whatever it left behind
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                pid, ticks = line.split()
                processes[int(pid)] = int(ticks)
    reaped = reap(processes)
    if reaped:
        print(f"scalarlm reaper: the engine's processes {reaped} outlived pid {parent}; stopped them", flush=True)
    return 0


class EngineReaper:
    """The watcher of the engine's processes: make it just before the engine starts, `watch()` once it runs (the
    processes started in between are the engine's), `close()` after it stops."""

    def __init__(self) -> None:
        self._before = {pid for pid, _ in descendants(os.getpid())}  # e.g. a test's own servers: not the engine's
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "scalarlm.inference.reaper"], stdin=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches the server, which stops the engine itself
        )  # fmt: skip

    def watch(self) -> list[int]:
        """Tell the reaper the processes started under this one since it was made (the engine's); return them."""
        found = [(pid, ticks) for pid, ticks in descendants(os.getpid())
                 if pid != self._proc.pid and pid not in self._before]  # fmt: skip
        if found and self._proc.stdin is not None:
            try:
                self._proc.stdin.write(b"".join(f"{pid} {ticks}\n".encode() for pid, ticks in found))
                self._proc.stdin.flush()
            except OSError as e:  # the reaper is gone (killed with our process group): nothing to tell
                logger.warning("engine reaper %d is gone: %s", self._proc.pid, e)
        logger.info("engine processes watched by reaper %d: %s", self._proc.pid, [pid for pid, _ in found])
        return [pid for pid, _ in found]

    def close(self, timeout: float = 10.0) -> None:
        """The engine is shut down: the reaper stops what it left behind, then exits."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


if __name__ == "__main__":
    sys.exit(main())
