"""Finding a process again by pid without being fooled by pid reuse (Linux /proc)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (after the command name), or None when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rfind(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it does not exist."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 of stat


def is_alive(pid: int, ticks: int | None) -> bool:
    """True when `pid` runs (not a zombie) and, if `ticks` is known, is the same process that was launched."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return False
    return ticks is None or int(fields[19]) == ticks


def signal_group(pid: int, sig: signal.Signals) -> bool:
    """Send `sig` to the process group led by `pid` (launched with a new session); False if it is gone."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False
