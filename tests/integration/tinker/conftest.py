"""One real `scalarlm serve` (tiny model, in-process vLLM) and one `tinker.ServiceClient` on it, shared by every
Tinker test module of this package: each module makes its own training clients, so they do not interfere, and the
suite pays the server's start once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

KEY = "tml-scalarlm-test-key"  # full scope (admin): sees every run
# Two teams' keys (train and generate only): each sees its own runs in the RestClient listings.
TEAM_KEYS = ("tml-team-a-key", "tml-team-b-key")
LIMITED_KEY = "tml-one-trainer-key"  # train,generate with max_jobs=1


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, serve_process) -> Iterator[tuple[str, Path]]:
    """(URL, home) of the shared server; its API keys are KEY and TEAM_KEYS."""
    # Each training client is a trainer process; those of a finished module end after 5 idle minutes instead of
    # the default 30, so the ~13 clients of the package do not all hold their memory to the end.
    keys_file = tmp_path_factory.mktemp("tinker-keys") / "keys"
    keys_file.write_text("".join(f"{key} train,generate\n" for key in TEAM_KEYS)
                         + f"{LIMITED_KEY} train,generate max_jobs=1\n")
    env = {"SCALARLM_API_KEYS": KEY, "SCALARLM_API_KEYS_FILE": str(keys_file), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "SCALARLM_TRAINING__SESSION_IDLE_SECONDS": "300"}
    with serve_process(tmp_path_factory.mktemp("tinker-server"), tiny_model_dir, env) as (url, home, _):
        yield url, home


@pytest.fixture(scope="package")
def service(server: tuple[str, Path]) -> Iterator[Any]:
    tinker = pytest.importorskip("tinker")
    client = tinker.ServiceClient(base_url=server[0], api_key=KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="package")
def keys() -> dict[str, str]:
    """The server's keys by role: "admin" (KEY), "a" and "b" (TEAM_KEYS), "limited" (max_jobs=1)."""
    return {"admin": KEY, "a": TEAM_KEYS[0], "b": TEAM_KEYS[1], "limited": LIMITED_KEY}
