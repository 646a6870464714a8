"""Fixtures for the static deployment checks (chart, values, infra, Dockerfiles)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from deploy_files import CHART


@pytest.fixture(scope="session")
def schema() -> dict[str, Any]:
    """The chart's values.schema.json."""
    return json.loads((CHART / "values.schema.json").read_text())
