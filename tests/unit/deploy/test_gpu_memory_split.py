"""The GPU memory split (vLLM's share, the trainer's ranks' share) is the same in the code, docs/deploy.md and
the chart: the chart's workers get the dedicated share, and on GPUs their KV cache follows it (no byte size)."""

from __future__ import annotations

import re
import tempfile

import pytest
import yaml
from deploy_files import CHART, REPO, VALUES_FILES, load_values

from scalarlm.config import (
    DEDICATED_VLLM_SHARE,
    SHARED_HEADROOM,
    SHARED_TRAINER_SHARE,
    SHARED_VLLM_SHARE,
    Settings,
    gpu_memory_split,
    load_settings,
)

DEPLOY_MD = (REPO / "docs" / "deploy.md").read_text()


def _docs_row(placement: str) -> tuple[float, float]:
    match = re.search(rf"^\| {placement} \| ([0-9.]+) \| ([0-9.]+) \|", DEPLOY_MD, re.M)
    assert match, f"docs/deploy.md Sizing has no '{placement}' row"
    return float(match.group(1)), float(match.group(2))


def test_docs_state_the_code_split():
    assert _docs_row("dedicated") == (DEDICATED_VLLM_SHARE, 0.0)
    assert _docs_row("shared") == (SHARED_VLLM_SHARE, SHARED_TRAINER_SHARE)
    assert f"{SHARED_HEADROOM:.2f} of each GPU stays free" in DEPLOY_MD


def test_code_defaults_follow_the_placement(tmp_path):
    embedded = Settings(home=tmp_path, server={"role": "embedded"}, training={"launcher": "local"})
    worker = Settings(home=tmp_path, server={"role": "worker"})
    assert tuple(gpu_memory_split(embedded)) == (SHARED_VLLM_SHARE, SHARED_TRAINER_SHARE)
    assert tuple(gpu_memory_split(worker)) == (DEDICATED_VLLM_SHARE, 0.0)
    assert worker.engine.kv_cache_bytes is None


def test_chart_default_is_the_dedicated_share():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["worker"]["gpuMemoryUtilization"] == DEDICATED_VLLM_SHARE
    text = (CHART / "values.yaml").read_text()
    assert f"{SHARED_VLLM_SHARE:.2f} (vLLM) and {SHARED_TRAINER_SHARE:.2f}" in text


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.name)
def test_rendered_worker_settings_give_vllm_the_values_share(values_file, monkeypatch):
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the dev extra) renders the chart")
    values = load_values(values_file)
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="prod", namespace="ml")
    configmap = yaml.safe_load(manifests["scalarlm/templates/configmap-settings.yaml"])
    for name in [k for k in __import__("os").environ if k.startswith("SCALARLM_")]:
        monkeypatch.delenv(name)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(configmap["data"]["settings.yaml"])
        f.flush()
        settings = load_settings(f.name, server={"role": "worker"})  # the worker pod's `--role worker`
    assert settings.engine.kv_cache_bytes is None, "a byte size would make vLLM ignore the GPU share"
    assert tuple(gpu_memory_split(settings)) == (values["worker"]["gpuMemoryUtilization"], 0.0)
