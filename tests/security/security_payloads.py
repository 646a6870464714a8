"""Payloads for the security tests: an SDK-shaped training archive and a trainer that runs until SIGTERM."""

from __future__ import annotations

import io
import json
import tarfile

# A trainer program for the LocalLauncher that follows the file contract and runs until SIGTERM,
# so a job stays RUNNING as long as a test needs it (the real trainer is tested in training_api/).
LONG_TRAINER = """
import json, os, signal, sys, time, pathlib
job = pathlib.Path(sys.argv[1])
def status(**changes):
    s = json.loads((job / "status.json").read_text()); s.update(changes)
    (job / "status.json.tmp").write_text(json.dumps(s)); os.replace(job / "status.json.tmp", job / "status.json")
def on_term(signum, frame):
    status(status="CANCELLED" if (job / "cancel.requested").exists() else "FAILED", reason="stopped by SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
status(status="RUNNING", start_time=time.time())
while True:
    time.sleep(0.05)
"""

ROWS = [{"input": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(4)]


def dataset_archive(extra_code: bytes | None = None) -> bytes:
    """A tar.gz like the ScalarLM SDK's: dataset.jsonlines, plus an ml/ program when `extra_code` is given."""
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in (("dataset.jsonlines", data), ("ml/cray_megatron/main.py", extra_code)):
            if body is not None:
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()
