"""The engine reaper with real processes: a parent makes an `EngineReaper`, starts "engine" children, watches them
and is SIGKILLed; the children started after the reaper die, a child started before it (not the engine's) lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from scalarlm.inference.reaper import TERM_GRACE_SECONDS, ignores_sigterm
from scalarlm.launcher.process import is_alive, start_ticks

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from scalarlm.inference.reaper import EngineReaper
    before = subprocess.Popen(["sleep", "600"])
    reaper = EngineReaper()
    engine = subprocess.Popen(["sleep", "600"])
    stubborn = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ok', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE)
    stubborn.stdout.readline()
    watched = reaper.watch()
    print(before.pid, engine.pid, stubborn.pid, *watched, flush=True)
    if sys.argv[1] == "close":
        started = time.monotonic()
        reaper.close()
        print("closed", time.monotonic() - started, flush=True)
    time.sleep(600)
""")


def run_parent(mode: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    return proc, pids


def wait_gone(pids: list[tuple[int, int | None]], seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(is_alive(p, t) for p, t in pids):
        time.sleep(0.1)
    return [p for p, t in pids if is_alive(p, t)]


def test_a_sigkilled_parent_leaves_no_engine_process_behind() -> None:
    proc, (before, engine, stubborn, *watched) = run_parent("kill")
    assert sorted(watched) == sorted([engine, stubborn])  # the child started before the reaper is not the engine's
    tracked = [(p, start_ticks(p)) for p in (engine, stubborn)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_gone(tracked) == []  # SIGTERM, then SIGKILL for the one that ignores it
    assert is_alive(before, None)
    os.kill(before, signal.SIGKILL)


def test_close_after_a_normal_stop_stops_what_the_engine_left() -> None:
    proc, (before, engine, stubborn, *_) = run_parent("close")
    lines = [proc.stdout.readline().strip() for _ in range(2)]  # the reaper reports to the same stdout
    assert lines[1].startswith("closed ") and lines[0].startswith("scalarlm reaper: the engine's processes"), lines
    assert wait_gone([(engine, None), (stubborn, None)], seconds=1.0) == []  # close() waits for the reaper
    # the process that ignores SIGTERM (as multiprocessing's resource tracker does) is killed without the grace
    # period, which could only end in SIGKILL
    assert float(lines[1].split()[1]) < TERM_GRACE_SECONDS
    assert proc.poll() is None and is_alive(before, None)
    proc.kill()
    proc.wait()
    os.kill(before, signal.SIGKILL)


def test_ignores_sigterm_reads_the_process_signal_mask() -> None:
    deaf = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print(flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
    plain = subprocess.Popen(["sleep", "600"])
    try:
        deaf.stdout.readline()
        assert ignores_sigterm(deaf.pid) and not ignores_sigterm(plain.pid)
    finally:
        for proc in (deaf, plain):
            proc.kill()
            proc.wait()
    assert not ignores_sigterm(plain.pid)  # gone: nothing to read
