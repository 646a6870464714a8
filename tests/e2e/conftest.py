"""One real `scalarlm serve` subprocess (control plane + in-process vLLM worker) for the e2e tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def server_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
               serve_process: Callable[..., Any]) -> Iterator[str]:
    """URL of a running `scalarlm serve --model <tiny>` on a free loopback port."""
    with serve_process(tmp_path_factory.mktemp("e2e-server"), tiny_model_dir) as (url, _, _):
        yield url


@pytest.fixture(scope="session")
def model_name(tiny_model_dir: Path) -> str:
    """The name the server gives the base model (the model directory's name)."""
    return tiny_model_dir.name
