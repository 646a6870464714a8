"""ScalarLM's own SDK (scalarlm==1.151, `masint`) works unchanged against scalarlm serve.

The SDK owns the module names `scalarlm` and `masint`, so it lives in its own venv (build/venv-sdk).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SDK_VENV = REPO / "build" / "venv-sdk"
SDK_PYTHON = SDK_VENV / "bin" / "python"
# matplotlib and humanize are only for the SDK's CLI; `import masint` needs these.
SDK_PACKAGES = ["aiohttp", "aiofiles", "jsonlines"]

SCRIPT = """
import json, sys
import masint
llm = masint.SupermassiveIntelligence(api_url=sys.argv[1])
count = int(sys.argv[2])
texts = llm.generate([f"What is {i} + 2?" for i in range(count)], max_tokens=8)
status = {"health": llm.health(), "models": llm.list_models(), "gpus": llm.get_gpu_count(),
          "nodes": llm.get_node_count(), "metrics": llm.metrics()}
print(json.dumps({"texts": texts, **status}))
"""


def _sdk_ready() -> bool:
    return SDK_PYTHON.exists() and subprocess.run([SDK_PYTHON, "-c", "import masint"],
                                                  capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def sdk_python() -> Path:
    """A venv with ScalarLM's SDK 1.151, created once (idempotent)."""
    if _sdk_ready():
        return SDK_PYTHON
    steps = [
        [sys.executable, "-m", "venv", str(SDK_VENV)],
        [str(SDK_PYTHON), "-m", "pip", "install", "-q", "--no-deps", "scalarlm==1.151"],
        [str(SDK_PYTHON), "-m", "pip", "install", "-q", *SDK_PACKAGES],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"cannot build the SDK venv ({' '.join(step[-2:])}): {done.stderr[-500:]}")
    return SDK_PYTHON


@pytest.mark.slow
@pytest.mark.parametrize("count", [3, 130], ids=["generate", "upload-download"])
def test_sdk_generate(sdk_python: Path, server_url: str, count: int) -> None:
    done = subprocess.run([sdk_python, "-c", SCRIPT, server_url, str(count)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out["texts"]) == count and all(isinstance(t, str) and t for t in out["texts"])
    assert out["health"]["all"] == "up"
    assert isinstance(out["models"]["models"], list)
    assert out["gpus"] >= 0 and out["nodes"] >= 1
    assert out["metrics"]["total_completed"] >= count
