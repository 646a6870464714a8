"""The layering of ARCHITECTURE.md holds: import-linter's contracts in pyproject.toml all pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
