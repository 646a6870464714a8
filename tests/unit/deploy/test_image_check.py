"""scripts/image_check.py, the images' last build step, passes in the development venv as the Dockerfiles run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from deploy_files import REPO
from test_dockerfiles import DOCKERFILES, instructions


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_copy_and_run_the_check(dockerfile):
    steps = instructions(dockerfile)
    assert ("COPY", "scripts/image_check.py /opt/scalarlm/image_check.py") in steps
    runs = [a for k, a in steps if k == "RUN" and "image_check.py" in a]
    assert len(runs) == 1 and "VLLM_TARGET_DEVICE=cpu" in runs[0] and "/opt/scalarlm/image_check.py" in runs[0]
    # It runs after scalarlm is installed, in the final stage.
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    assert steps.index(("RUN", runs[0])) > last_from
    assert "!scripts/image_check.py" in (REPO / ".dockerignore").read_text().splitlines()


@pytest.mark.slow
def test_image_check_passes_here():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCALARLM_")} | {"VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "image_check.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["modules"] > 50 and report["platform"] == "cpu"
    assert report["engine_config_kv_bytes"] == 1 << 30 and report["engine_config_max_model_len"] == 256
    assert report["accelerator_gpu_memory_utilization"] in (0.40, 0.85)
