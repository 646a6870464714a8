"""What the ScalarLM SDK sends (tar.gz with dataset.jsonlines + ml/, multipart file + JSON params) and a stand-in
trainer program that follows the trainer's file contract (status.json, metrics.jsonl, rank logs)."""

from __future__ import annotations

import io
import json
import tarfile

from fastapi.testclient import TestClient

STAND_IN_TRAINER = """
    import json, os, sys, time, pathlib
    job = pathlib.Path(sys.argv[1])
    def status(**changes):
        s = json.loads((job / "status.json").read_text())
        s.update(changes)
        (job / "status.json.tmp").write_text(json.dumps(s)); os.replace(job / "status.json.tmp", job / "status.json")
    (job / "logs").mkdir(exist_ok=True)
    (job / "logs" / "rank-0.log").write_text("stand-in trainer rank 0\\n")
    status(status="RUNNING", start_time=time.time())
    if "max_steps: 13\\n" in (job / "job.yaml").read_text():  # a job whose trainer crashes without a status
        print("ValueError: loss is NaN at step 2", flush=True)
        sys.exit(1)
    if "max_steps: 1000000" in (job / "job.yaml").read_text():  # a job that runs until cancelled
        import signal
        def on_term(signum, frame):
            status(status="CANCELLED" if (job / "cancel.requested").exists() else "FAILED", reason="stopped by SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        while True:
            time.sleep(0.05)
    for step in (1, 2, 3):
        with open(job / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": 4.0 / step, "lr": 1e-3, "time": time.time()}) + "\\n")
    status(status="COMPLETED", step=3, loss=4.0 / 3, end_time=time.time())
"""

ROWS = [{"input": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(8)]


def sdk_archive(rows: list[dict] | None = None, *, with_ml: bool = True, extra: list[tarfile.TarInfo] = ()) -> bytes:
    """A tar.gz shaped like the ScalarLM SDK's: dataset.jsonlines plus (optionally) a bundled ml/ directory."""
    data = "".join(json.dumps(r) + "\n" for r in (ROWS if rows is None else rows)).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("dataset.jsonlines")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        if with_ml:
            code = b"raise SystemExit('uploaded code must never run')\n"
            info = tarfile.TarInfo("ml/cray_megatron/main.py")
            info.size = len(code)
            tar.addfile(info, io.BytesIO(code))
        for member in extra:
            tar.addfile(member, io.BytesIO(b"x" * member.size) if member.isfile() else None)
    return buf.getvalue()


def post_train(client: TestClient, archive: bytes, params: dict | str | None = None, path: str = "/v1/megatron/train"):
    """POST the archive the way the SDK does: multipart `file` (filename 'dataset') and JSON `params`."""
    files = {"file": ("dataset", archive, "application/octet-stream")}
    if params is not None:
        files["params"] = (None, params if isinstance(params, str) else json.dumps(params), "application/json")
    return client.post(path, files=files)
