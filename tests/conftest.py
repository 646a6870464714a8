"""Fixtures shared by the whole suite. Nothing here downloads anything."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama model + tokenizer, built once per test session (a few seconds)."""
    from scalarlm.cli.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
