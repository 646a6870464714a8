"""Routing that fits hot-swap, through the real control plane and queue: each worker's get_work says which full
weights its engine holds, the queue leases it work it can run without a swap first, and /metrics shows what every
worker last reported (load, swaps, loaded versions, held weights)."""

from __future__ import annotations

from scalarlm.protocol.generate import ModelVersion
from scalarlm.queue.service import runs_without_swap

CATALOG = [ModelVersion(name="tiny", kind="base"), ModelVersion(name="job-a", version=3, kind="full", path="/a"),
           ModelVersion(name="job-b", version=5, kind="full", path="/b"),
           ModelVersion(name="job-l", version=2, kind="lora", path="/l")]  # fmt: skip


def test_what_a_worker_runs_without_reloading_weights() -> None:
    assert runs_without_swap("job-a", CATALOG) == {"job-a"}
    assert runs_without_swap("tiny", CATALOG) == {"tiny", "job-l"}  # adapters sit on the base weights
    assert runs_without_swap(None, CATALOG) == set()


async def test_each_worker_gets_the_work_of_the_weights_it_holds_and_metrics_show_it(client) -> None:
    queued = await client.post("/v1/generate", json={"prompts": ["a", "b"], "max_tokens": 2})
    assert queued.status_code == 200, queued.text
    load = {"running": 2, "waiting": 1, "max_num_seqs": 8, "kv_cache_usage": 0.25, "swaps": 3, "swap_seconds": 1.5}
    work = {"worker_id": "w1", "capacity": 4, "load": load, "loaded": {"tiny": 0, "job-l": 2}, "holding": "tiny"}
    leased = (await client.post("/v1/generate/get_work", json=work)).json()
    assert [r["model"] for r in leased["requests"]] == ["tiny", "tiny"]
    idle = {"worker_id": "w2", "capacity": 0, "loaded": {"tiny": 0}, "holding": "tiny"}
    assert (await client.post("/v1/generate/get_work", json=idle)).status_code == 200

    text = (await client.get("/metrics")).text
    for line in ('scalarlm_worker_swaps{worker="w1"} 3.0', 'scalarlm_worker_swap_seconds{worker="w1"} 1.5',
                 'scalarlm_worker_running{worker="w1"} 2.0', 'scalarlm_worker_kv_cache_usage{worker="w1"} 0.25',
                 'scalarlm_worker_model_version{model="job-l",worker="w1"} 2.0',
                 'scalarlm_worker_holding{model="tiny",worker="w2"} 1.0'):  # fmt: skip
        assert line in text, line
    assert 'scalarlm_worker_last_seen_seconds{worker="w2"}' in text
    assert 'scalarlm_worker_running{worker="w2"}' not in text  # w2 sent no load


async def test_every_grafana_panel_queries_a_metric_the_control_plane_exposes(running_app) -> None:
    """The chart's dashboard (deployment/helm/scalarlm/dashboards/scalarlm.json) against the /metrics of a split
    control plane, as the chart runs it (its one worker URL answers nothing here: loads count as idle)."""
    import json
    import re
    from pathlib import Path

    dashboard = Path(__file__).parents[3] / "deployment" / "helm" / "scalarlm" / "dashboards" / "scalarlm.json"
    load = {"running": 1, "max_num_seqs": 8, "swaps": 1}
    async with running_app(server={"role": "api", "worker_urls": ["http://127.0.0.1:9"]}) as client:
        await client.post("/v1/generate/get_work", json={"worker_id": "w1", "capacity": 0, "load": load,
                                                         "loaded": {"tiny": 0}, "holding": "tiny"})  # fmt: skip
        exposed = set(re.findall(r"^(scalarlm_[a-z_]+)", (await client.get("/metrics")).text, re.MULTILINE))
    queried = {name for panel in json.loads(dashboard.read_text())["panels"] for target in panel["targets"]
               for name in re.findall(r"scalarlm_[a-z_]+", target["expr"])}  # fmt: skip
    assert queried and queried <= exposed, sorted(queried - exposed)
