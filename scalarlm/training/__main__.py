"""`python -m scalarlm.training <job_dir>`: run one rank of the training job in `job_dir`.

Started by the launcher under `mpirun -n <ranks>` (or torchrun, or as one plain process). Exit code 0 when the job
completed, was cancelled, or was stopped by SIGTERM with its state saved; 1 when it failed (see status.json).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

from scalarlm.training.job import run_job


def main(argv: list[str] | None = None) -> int:
    """Parse the job directory argument and run this rank."""
    parser = argparse.ArgumentParser(prog="python -m scalarlm.training", description=__doc__.splitlines()[0])
    parser.add_argument("job_dir", type=Path, help="jobs/<job_id>/ holding job.yaml and dataset.jsonl")
    args = parser.parse_args(argv)
    return run_job(args.job_dir, os.environ)


if __name__ == "__main__":
    code = main()
    # The job has ended (its status, checkpoints and metrics are written and closed): leave torch's, megatron's and
    # transformers' objects out of the interpreter's last collection, which walked them for 1-2 s after every job.
    gc.freeze()
    sys.exit(code)
