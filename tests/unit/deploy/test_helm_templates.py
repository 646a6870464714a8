"""The chart's templates: YAML structure without Helm, then a real render and lint through Helm's Go SDK."""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import CHART, VALUES_FILES, load_values
from template_yaml import parse_template

TEMPLATES = sorted(p for p in (CHART / "templates").rglob("*.yaml"))
REQUIRED = {
    ("Deployment", "api"), ("Deployment", "worker"), ("Service", "api"), ("Service", "worker"),
    ("StatefulSet", "slurmctld"), ("StatefulSet", "slurmd"), ("Service", "slurmctld"), ("Service", "slurmd"),
    ("PersistentVolumeClaim", "shared"), ("ConfigMap", "settings"), ("ConfigMap", "slurm"),
    ("Secret", "api-keys"), ("Secret", "munge"), ("Secret", "worker-key"), ("Pod", "test-generate"),
    ("ConfigMap", "grafana-dashboard"),
}


# ---- without Helm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: str(p.relative_to(CHART / "templates")))
def test_template_is_yaml_after_stripping_actions(template):
    docs = parse_template(template.read_text())
    assert docs, f"{template.name} holds no object"
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{template.name}: {sorted(doc)}"


def test_templates_hold_every_required_kind():
    kinds = Counter(doc["kind"] for t in TEMPLATES for doc in parse_template(t.read_text()))
    assert kinds["Deployment"] == 2 and kinds["StatefulSet"] == 2 and kinds["Service"] == 4
    assert kinds["PersistentVolumeClaim"] == 1 and kinds["ConfigMap"] == 3 and kinds["Secret"] == 3
    assert kinds["Pod"] == 1


def test_probes_and_pvc_read_without_helm():
    text = {t.name: t.read_text() for t in TEMPLATES}
    (pvc,) = parse_template(text["pvc.yaml"])
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for name, path in (("api-deployment.yaml", '"/v1/health"'), ("worker-deployment.yaml", ".Values.worker.healthPath")):
        probes = re.findall(
            r"(readinessProbe|livenessProbe|startupProbe):\n\s*\{\{- include \"scalarlm.healthProbe\" \(dict \"path\" (\S+)",
            text[name],
        )
        assert sorted(probes) == [(p, path) for p in ("livenessProbe", "readinessProbe", "startupProbe")], name


def test_helpers_and_notes_exist():
    assert (CHART / "templates" / "_helpers.tpl").is_file()
    assert (CHART / "templates" / "NOTES.txt").is_file()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "scalarlm"


# ---- rendered by Helm's own Go code (helm-python-sdk, no helm binary) -----------------------------

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the dev extra) renders the chart without a helm binary")


def _render(values_file: Path) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(load_values(values_file), name="prod", namespace="ml")
    docs: list[dict[str, Any]] = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.fixture(scope="module", params=VALUES_FILES, ids=lambda p: p.name)
def rendered(request) -> tuple[Path, list[dict[str, Any]]]:
    return request.param, _render(request.param)


def _objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"].removeprefix("prod-scalarlm-"): d for d in docs if d["kind"] == kind}


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.name)
def test_helm_lint_finds_no_error(values_file):
    report = helm.lint(str(CHART), load_values(values_file), strict=True, namespace="ml")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_render_holds_every_required_object(rendered):
    _, docs = rendered
    found = {(d["kind"], d["metadata"]["name"].removeprefix("prod-scalarlm-")) for d in docs}
    assert REQUIRED <= found, f"missing: {sorted(REQUIRED - found)}"


def test_http_probes_point_at_health(rendered):
    values_file, docs = rendered
    paths = {"api": "/v1/health", "worker": load_values(values_file)["worker"]["healthPath"]}
    for role, path in paths.items():
        (container,) = _containers(_objects(docs, "Deployment")[role])
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["httpGet"]["path"] == path, (role, probe)


@pytest.mark.slow
def test_probe_paths_are_routes_of_the_real_apps(tmp_path):
    """The chart's probe paths exist in the control plane's and the worker's apps (the worker's imports vLLM)."""
    from scalarlm.config import Settings
    from scalarlm.inference.worker_app import create_worker_app
    from scalarlm.server.app import create_app

    settings = Settings(home=tmp_path)

    def get_routes(app) -> set[str]:
        return {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}

    values = load_values(CHART / "values.yaml")
    assert "/v1/health" in get_routes(create_app(settings))
    assert values["worker"]["healthPath"] in get_routes(create_worker_app(settings))


def test_one_shared_rwx_volume_is_mounted_at_home_by_every_pod(rendered):
    values_file, docs = rendered
    values = load_values(values_file)
    (pvc,) = _objects(docs, "PersistentVolumeClaim").values()
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    workloads = list(_objects(docs, "Deployment").values()) + list(_objects(docs, "StatefulSet").values())
    assert len(workloads) == 4
    for obj in workloads:
        volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
        assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        mounts = {m["name"]: m["mountPath"] for m in _containers(obj)[0]["volumeMounts"]}
        assert mounts["shared"] == values["persistence"]["mountPath"]


def test_gpu_requests_use_the_vendor_resource(rendered):
    values_file, docs = rendered
    values = load_values(values_file)
    resource = values["gpu"]["resourceName"]
    worker = _containers(_objects(docs, "Deployment")["worker"])[0]["resources"]
    assert worker["limits"][resource] == values["worker"]["gpus"]
    slurmd = _containers(_objects(docs, "StatefulSet")["slurmd"])[0]["resources"]
    assert slurmd["limits"][resource] == values["slurm"]["compute"]["gpusPerNode"]
    api = _containers(_objects(docs, "Deployment")["api"])[0]["resources"]
    assert resource not in api.get("limits", {}), "the control plane needs no GPU"


def test_rendered_settings_load_as_scalarlm_settings(rendered, monkeypatch):
    values_file, docs = rendered
    values = load_values(values_file)
    settings_yaml = _objects(docs, "ConfigMap")["settings"]["data"]["settings.yaml"]
    from scalarlm.config import load_settings

    for name in [k for k in os.environ if k.startswith("SCALARLM_")]:
        monkeypatch.delenv(name)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(settings_yaml)
        f.flush()
        settings = load_settings(f.name)
    assert settings.model == values["model"]
    assert str(settings.home) == values["persistence"]["mountPath"]
    assert settings.engine.tensor_parallel_size == values["worker"]["tensorParallelSize"]
    assert settings.engine.max_model_len == values["worker"]["maxModelLen"]  # null: vLLM's auto-fit
    assert settings.training.launcher == ("slurm" if values["slurm"]["enabled"] else "local")
    assert settings.server.api_url == "http://prod-scalarlm-api:8000"


def test_pods_run_as_non_root_except_slurm_daemons(rendered):
    _, docs = rendered
    for name, obj in _objects(docs, "Deployment").items():
        assert obj["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True, name
    for name, obj in _objects(docs, "StatefulSet").items():
        assert obj["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 0, name


def test_helm_test_hook_runs_one_generate(rendered):
    _, docs = rendered
    pod = _objects(docs, "Pod")["test-generate"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    assert "/v1/generate" in script and "wait_seconds" in script


def test_slurm_pods_share_one_rendered_slurm_config(rendered):
    _, docs = rendered
    slurm_env = _objects(docs, "ConfigMap")["slurm"]["data"]
    assert slurm_env["SLURM_CONTROLLER_HOST"] == "prod-scalarlm-slurmctld-0"
    assert slurm_env["SLURMD_STATEFULSET"] == "prod-scalarlm-slurmd"
    for obj in [_objects(docs, "Deployment")["api"], *_objects(docs, "StatefulSet").values()]:
        refs = [e["configMapRef"]["name"] for e in _containers(obj)[0].get("envFrom", [])]
        assert "prod-scalarlm-slurm" in refs
    for name in ("slurmctld", "slurmd"):
        svc = _objects(docs, "Service")[name]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True


def test_tensor_parallel_beyond_gpus_fails_to_render():
    values = load_values(CHART / "values.yaml")
    values["worker"].update(gpus=1, tensorParallelSize=2)
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(Exception, match="tensorParallelSize"):
        chart.render(values, name="prod", namespace="ml")


def test_scoped_keys_file_is_mounted_in_the_api_pod_only():
    values = load_values(CHART / "values.yaml")
    values["auth"]["keysFileSecret"] = "team-keys"
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="prod", namespace="ml")
    api = yaml.safe_load(manifests["scalarlm/templates/api-deployment.yaml"])
    (container,) = _containers(api)
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["SCALARLM_API_KEYS_FILE"] == f"{mounts['keys-file']}/keys"
    volumes = {v["name"]: v for v in api["spec"]["template"]["spec"]["volumes"]}
    assert volumes["keys-file"]["secret"]["secretName"] == "team-keys"
    worker = yaml.safe_load(manifests["scalarlm/templates/worker-deployment.yaml"])
    assert "team-keys" not in json.dumps(worker)


def _worker_key_file(manifests: dict[str, str], template: str) -> tuple[str, str]:
    """(the SCALARLM_WORKER_KEY_FILE a deployment's pod reads, the Secret mounted where it points)."""
    deployment = yaml.safe_load(manifests[f"scalarlm/templates/{template}"])
    (container,) = _containers(deployment)
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    path = env["SCALARLM_WORKER_KEY_FILE"]
    mount = mounts[str(Path(path).parent)]
    return path, volumes[mount]["secret"]["secretName"]


def test_the_worker_key_comes_from_one_chart_secret_mounted_in_the_api_and_worker_pods(monkeypatch):
    from scalarlm.config import load_settings

    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(load_values(CHART / "values.yaml"), name="prod", namespace="ml")
    secret = yaml.safe_load(manifests["scalarlm/templates/secret-worker-key.yaml"])
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # kept across upgrades
    assert len(base64.b64decode(secret["data"]["worker.key"]).decode()) >= 32
    api = _worker_key_file(manifests, "api-deployment.yaml")
    worker = _worker_key_file(manifests, "worker-deployment.yaml")
    assert api == worker == ("/etc/scalarlm-worker-key/worker.key", secret["metadata"]["name"])
    monkeypatch.setenv("SCALARLM_WORKER_KEY_FILE", api[0])  # the pods' env is the setting's shortcut
    assert load_settings().server.worker_key_file == Path(api[0])
    for text in manifests.values():  # the key itself travels in the Secret only
        assert secret["data"]["worker.key"] not in text or text == manifests["scalarlm/templates/secret-worker-key.yaml"]


def test_an_existing_worker_key_secret_is_mounted_and_none_is_created():
    values = load_values(CHART / "values.yaml")
    values["auth"]["workerKeySecret"] = "team-worker-key"
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="prod", namespace="ml")
    assert not (manifests.get("scalarlm/templates/secret-worker-key.yaml") or "").strip()
    for template in ("api-deployment.yaml", "worker-deployment.yaml"):
        assert _worker_key_file(manifests, template)[1] == "team-worker-key"


def test_grafana_dashboard_configmap_carries_the_sidecar_label_and_parses(rendered):
    _, docs = rendered
    dashboard = _objects(docs, "ConfigMap")["grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    panels = json.loads(dashboard["data"]["scalarlm.json"])["panels"]
    assert panels and all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)
    (api,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-api")]
    annotations = api["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
