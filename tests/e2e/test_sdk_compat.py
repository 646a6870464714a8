"""ScalarLM's own SDK (scalarlm==1.151, `masint`) works unchanged against scalarlm serve.

The SDK owns the module names `scalarlm` and `masint`, so it lives in its own venv (build/venv-sdk, built once by
the `sdk_python` fixture in tests/conftest.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest


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
