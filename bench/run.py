"""`make bench`: run every benchmark; each prints its figures and merges them into build/bench/results.json."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITES = ["bench.serving", "bench.training", "bench.grpo", "bench.publish_latency"]

if __name__ == "__main__":
    failed = [m for m in SUITES if subprocess.run([sys.executable, "-m", m, *sys.argv[1:]], cwd=ROOT).returncode]
    sys.exit(1 if failed else 0)
