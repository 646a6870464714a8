"""`scalarlm generate` prints one completion per prompt from a running server."""

from __future__ import annotations

import subprocess
import sys


def test_cli_generate_prints_each_completion(server_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "scalarlm.cli", "generate", "Hello", "What is 1 + 1?",
         "--api-url", server_url, "--max-tokens", "4"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout.rstrip("\n").split("\n")) >= 2


def test_cli_generate_reports_typed_errors(server_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "scalarlm.cli", "generate", "Hello", "--api-url", server_url,
         "--model-name", "no-such-model"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1 and "NotFound" in done.stderr
