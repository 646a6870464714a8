"""ScalarLM's own SDK (scalarlm==1.151, `masint`) trains against our control plane unchanged: single POST and chunked.

Runs in the SDK's own venv (build/venv-sdk, the `sdk_python` fixture of tests/conftest.py: packages from PyPI,
never model weights).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest


SCRIPT = """
import json, sys, time
import masint
llm = masint.SupermassiveIntelligence(api_url=sys.argv[1])
rows = [{"input": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(40)]
submitted = llm.train(rows, train_args={"max_steps": 3, "learning_rate": 1e-3})
job_id = submitted["job_status"]["job_id"]
while True:
    job = llm.get_training_job(job_id)
    if job["job_status"]["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
        break
    time.sleep(0.2)
long = llm.train(rows, train_args={"max_steps": 1000000})["job_status"]["job_id"]
cancelled = llm.cancel(long)
deleted = llm.delete(long)
print(json.dumps({"submitted": submitted, "job": job, "models": llm.list_models(), "cancelled": cancelled,
                  "deleted": deleted}))
"""


@pytest.mark.parametrize("chunked", [False, True], ids=["single-post", "chunked"])
def test_scalarlm_sdk_trains_watches_cancels_and_deletes(sdk_python: Path, live_url, tmp_path, chunked):
    env = {"PATH": "/usr/bin:/bin"}
    if chunked:  # the SDK reads these at import: force its init/chunk/finalize path with small chunks
        env.update(MASINT_SINGLE_POST_THRESHOLD="0", MASINT_UPLOAD_CHUNK_SIZE="1024")
    done = subprocess.run([sdk_python, "-c", SCRIPT, live_url], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])

    status = out["submitted"]["job_status"]
    assert status["job_id"].startswith("job-") and status["model_name"] == status["job_id"]
    assert out["submitted"]["job_config"]["dataset_rows"] == 40
    assert out["job"]["job_status"]["status"] == "COMPLETED"
    assert [h["step"] for h in out["job"]["job_status"]["history"]] == [1, 2, 3]  # what `scalarlm plot` reads
    assert out["job"]["job_config"]["job_directory"].endswith(status["job_id"])
    assert status["job_id"] in [m["name"] for m in out["models"]["models"]]
    assert out["cancelled"]["status"] == "CANCELLED"
    assert out["deleted"]["deleted"] is True
