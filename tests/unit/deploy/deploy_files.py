"""Paths of the deployment files and the values merge Helm does, for the static deployment checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deployment" / "helm" / "scalarlm"
INFRA = REPO / "infra"
VALUES_FILES = sorted(CHART.glob("values*.yaml"))
EXAMPLE_VALUES = [p for p in VALUES_FILES if p.name != "values.yaml"]


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Merge `overlay` over `base` the way Helm merges a -f file over the chart's values.yaml."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_values(path: Path) -> dict[str, Any]:
    """The values Helm would use with `-f path`: the chart's defaults with the file merged over."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    return deep_merge(defaults, yaml.safe_load(path.read_text()) or {})
