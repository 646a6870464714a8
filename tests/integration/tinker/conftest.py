"""One real `scalarlm serve` (tiny model, in-process vLLM) and one `tinker.ServiceClient` on it, shared by every
Tinker test module of this package: each module makes its own training clients, so they do not interfere, and the
suite pays the server's start once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

KEY = "tml-scalarlm-test-key"


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, serve_process) -> Iterator[tuple[str, Path]]:
    """(URL, home) of the shared server; its API key is KEY."""
    # Each training client is a trainer process; those of a finished module end after 5 idle minutes instead of
    # the default 30, so the ~13 clients of the package do not all hold their memory to the end.
    env = {"SCALARLM_API_KEYS": KEY, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "SCALARLM_TRAINING__SESSION_IDLE_SECONDS": "300"}
    with serve_process(tmp_path_factory.mktemp("tinker-server"), tiny_model_dir, env) as (url, home, _):
        yield url, home


@pytest.fixture(scope="package")
def service(server: tuple[str, Path]) -> Iterator[Any]:
    tinker = pytest.importorskip("tinker")
    client = tinker.ServiceClient(base_url=server[0], api_key=KEY)
    yield client
    client.close("success").result()
