"""ScalarLM's own SDK (scalarlm==1.151, `masint`) trains against our control plane unchanged: single POST and chunked.

Runs in the SDK's own venv (build/venv-sdk, the `sdk_python` fixture of tests/conftest.py: packages from PyPI,
never model weights).
"""

from __future__ import annotations

import json
import subprocess
import time
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


CLI_PACKAGES = ["matplotlib", "humanize"]  # what the SDK's CLI imports beyond `masint`'s own needs

TRAIN_ONE = """
import sys, time
import masint
llm = masint.SupermassiveIntelligence(api_url=sys.argv[1])
job_id = llm.train([{"input": "1 + 1?", "output": "2"}] * 8, train_args={"max_steps": 3})["job_status"]["job_id"]
while llm.get_training_job(job_id)["job_status"]["status"] not in ("COMPLETED", "FAILED", "CANCELLED"):
    time.sleep(0.2)
print(job_id)
"""


def test_scalarlm_sdk_cli_lists_queues_tails_and_plots_our_jobs(sdk_python: Path, live_url, tmp_path):
    """ScalarLM's own CLI (`scalarlm ls -A`, `squeue`, `logs`, `plot`, as its users run them) against our server: it
    logs its failures and exits 0, so its output is what is checked."""
    installed = subprocess.run([sdk_python, "-m", "pip", "install", "-q", *CLI_PACKAGES], capture_output=True,
                               text=True, timeout=600)  # fmt: skip
    if installed.returncode != 0:
        pytest.skip(f"cannot install the SDK CLI's packages: {installed.stderr[-500:]}")
    env = {"PATH": "/usr/bin:/bin", "SCALARLM_API_URL": live_url, "MPLBACKEND": "Agg", "HOME": str(tmp_path)}
    trained = subprocess.run([sdk_python, "-c", TRAIN_ONE, live_url], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path, env=env)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    job_id = trained.stdout.split()[-1]

    def cli(*args: str) -> str:
        done = subprocess.run([sdk_python, "-m", "masint.cli.main", *args], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path, env=env)  # fmt: skip
        assert done.returncode == 0 and "ERROR" not in done.stderr, (args, done.stderr[-3000:])
        return done.stdout

    header, _, *rows = cli("ls", "-A").splitlines()
    assert [c.strip() for c in header.split("|")][:3] == ["name", "deployed", "status"] and "train_time" in header
    [row] = [r for r in rows if r.startswith(job_id)]
    assert "COMPLETED" in row and time.strftime("%Y-%m-%d") in row  # start_time formatted, train_time humanized
    assert cli("ls").splitlines()[0] == job_id
    assert cli("ls", "-l", "1").splitlines() == [job_id]  # the newest job, as ScalarLM lists newest first

    assert cli("squeue").split()[:3] == ["JOBID", "STATUS", "LAUNCHER"]  # nothing queued or running

    logs = cli("logs").splitlines()  # the default model name is `latest`: the newest job
    assert any(line.endswith(" stand-in trainer rank 0") for line in logs), logs  # the rank's log, numbered
    numbers = [int(line.split(" ", 1)[0]) for line in logs]
    assert numbers == list(range(len(logs)))
    assert cli("logs", "--model", job_id) == "\n".join(logs) + "\n"

    cli("plot")  # the newest job's loss history, saved as a PDF named after its first 10 characters
    assert (tmp_path / f"loss_plot_{job_id[:10]}.pdf").stat().st_size > 1000
