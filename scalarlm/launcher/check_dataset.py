"""`python -m scalarlm.launcher.check_dataset <path>`: validate a dataset's rows in a child process.

The control plane must not import trainer code (import-linter contract), so it runs the trainer's own
row check here, as a process, and reads one JSON line back: {"rows": N} or {"error": ..., "param": ...}.
"""

from __future__ import annotations

import json
import sys

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.rows import validate_dataset


def main(argv: list[str]) -> int:
    """Print the row count, or the first bad line's error (exit code 2)."""
    if len(argv) != 1:
        print(json.dumps({"error": "usage: python -m scalarlm.launcher.check_dataset <path>"}))
        return 2
    try:
        rows = validate_dataset(argv[0])
    except InvalidRequest as e:
        print(json.dumps({"error": e.message, "param": e.param}))
        return 2
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
