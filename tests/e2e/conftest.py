"""The e2e tests run against the suite's one shared `scalarlm serve` of the tiny model (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def server_url(tiny_server: tuple[str, Path]) -> str:
    """URL of a running `scalarlm serve --model <tiny>` on a free loopback port (the suite's shared one)."""
    return tiny_server[0]


@pytest.fixture(scope="session")
def model_name(tiny_model_dir: Path) -> str:
    """The name the server gives the base model (the model directory's name)."""
    return tiny_model_dir.name
