"""A stand-in session trainer that follows the session file contract (`scalarlm.checkpoint.session`).

It copies the base model as each step's "new weights" so the control plane's side of a session (request
files, results, versions, end, a trainer that dies) is tested without the cost of real training; the real
trainer is exercised by test_closed_loop.py. A row whose completion is "die" makes it exit without a word; one
whose completion is "slow" makes its step take `SLOW_SECONDS`. Results carry the request index, the version that
generated the batch (from `meta-<k>.json`) and when the step started and finished.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from scalarlm.checkpoint import JobDir, publish_step
from scalarlm.checkpoint.session import SessionDir
from scalarlm.protocol.training import CheckpointManifest, SessionStepResult

# A test that fails before ending its session must not leave this process behind.
IDLE_EXIT_SECONDS = 60.0
SLOW_SECONDS = 1.0


def main(root: str) -> int:
    job = JobDir(Path(root))
    files = SessionDir(job)
    base = Path(job.read_config().base_model)
    job.update_status(status="RUNNING", start_time=time.time())
    k = 1
    idle_since = time.monotonic()
    while True:
        if files.end_requested() or time.monotonic() - idle_since > IDLE_EXIT_SECONDS:
            job.update_status(status="COMPLETED", end_time=time.time())
            return 0
        rows = files.read_request(k)
        if rows is None:
            time.sleep(0.02)
            continue
        idle_since = time.monotonic()
        started = time.time()
        if any(r.get("completion") == "die" for r in rows):
            return 3
        if any(r.get("completion") == "slow" for r in rows):
            time.sleep(SLOW_SECONDS)
        manifest = CheckpointManifest(job_id=job.job_id, step=k, base_model=str(base), kind="full", loss=1.0 / k)
        publish_step(job, manifest, lambda tmp: [shutil.copy(f, tmp / f.name) for f in base.iterdir() if f.is_file()])
        job.update_status(step=k, loss=1.0 / k)
        generated = files.read_meta(k).version
        files.write_result(k, SessionStepResult(
            step=k, version=k, loss=1.0 / k, metrics={"rows": len(rows)}, request=k, generated_version=generated,
            staleness=None if generated is None else k - 1 - generated, started=started, finished=time.time(),
        ))  # fmt: skip
        k += 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
