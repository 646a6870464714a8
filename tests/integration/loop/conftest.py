"""Fixtures of the closed-loop tests: a control plane over a temp home, with the tiny model as its base."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from scalarlm.config import Settings
from scalarlm.server.app import create_app


def loop_settings(home: Path, model: Path, **sections: Any) -> Settings:
    """Settings for a control plane on `home` serving `model` as `tiny`."""
    return Settings(model=str(model), served_model_name="tiny", home=home, **sections)


@pytest.fixture
async def control_plane(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Callable[..., Any]]:
    """`async with control_plane(worker=None, **sections) as (client, settings)`: the app with its lifespan run."""

    @asynccontextmanager
    async def start(worker: Any = None, **sections: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Settings]]:
        settings = loop_settings(tmp_path / "home", tiny_model_dir, **sections)
        app = create_app(settings, worker=worker)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://control-plane", timeout=60) as client:
                yield client, settings

    yield start


@pytest.fixture(scope="session")
def loop_server_home(tiny_server: tuple[str, Path]) -> tuple[str, Path]:
    """(URL, home) of a real `scalarlm serve` (control plane + in-process vLLM worker + local trainer launcher): the
    suite's shared one."""
    return tiny_server


@pytest.fixture(scope="session")
def loop_server(loop_server_home: tuple[str, Path]) -> str:
    """URL of the shared real `scalarlm serve`."""
    return loop_server_home[0]
