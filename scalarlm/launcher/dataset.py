"""Dataset row validation for the control plane, which may not import trainer code: it runs in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from scalarlm.protocol.errors import EngineUnavailable, InvalidRequest

CHECK_MODULE = "scalarlm.launcher.check_dataset"


def validate_rows(path: Path, *, python: str = sys.executable, timeout: float = 600.0) -> int:
    """Check every row of a JSONL dataset with the trainer's own rules; return the row count.

    Raises InvalidRequest naming the first bad line, or EngineUnavailable if the check cannot run.
    """
    try:
        done = subprocess.run(
            [python, "-m", CHECK_MODULE, str(path)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        raise EngineUnavailable(f"checking the dataset took longer than {timeout:.0f} s") from e
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if "rows" in answer and done.returncode == 0:
        return int(answer["rows"])
    if "error" in answer:
        raise InvalidRequest(str(answer["error"]), param=answer.get("param") or "dataset")
    raise EngineUnavailable(f"the dataset check failed to run: {done.stderr.strip()[-500:]}")
