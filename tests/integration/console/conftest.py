"""One real `scalarlm serve` (API keys on) for every test in this folder, and a small LoRA job trained on it."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from console_server import API_KEY, LORA_ARGS, ROWS, Server

from scalarlm.cli.main import main


@pytest.fixture(scope="package")
def server(serve_process: Callable[..., Any], tiny_model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # fmt: skip
    """The server every console, CLI and export test talks to."""
    with serve_process(tmp_path_factory.mktemp("console"), tiny_model_dir, {"SCALARLM_API_KEYS": API_KEY}) as (
        url, home, _,
    ):  # fmt: skip
        yield Server(url, home, API_KEY)


@pytest.fixture(scope="package")
def dataset_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


@pytest.fixture(scope="package")
def trained(server: Server, dataset_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A finished LoRA job (versions 2 and 4), trained through `scalarlm train --wait --json`: what it printed."""
    args_file = tmp_path_factory.mktemp("args") / "args.json"
    args_file.write_text(json.dumps(LORA_ARGS))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["train", str(dataset_file), "--train-args-file", str(args_file), "--wait", "--timeout", "300",
                   "--json", "--api-url", server.url, "--api-key", server.key])  # fmt: skip
    assert rc == 0, out.getvalue()
    return json.loads(out.getvalue())


@pytest.fixture(scope="package")
def lora_job(trained: dict[str, Any]) -> str:
    assert trained["status"] == "COMPLETED", trained
    return trained["job_id"]
