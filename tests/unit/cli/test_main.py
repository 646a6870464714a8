"""`scalarlm` argument parsing becomes one Settings object; unsafe exposure is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from scalarlm.cli.main import build_parser, serve_overrides
from scalarlm.cli.serve import InsecureExposure, check_exposure, is_loopback
from scalarlm.config import load_settings


def _settings(argv: list[str], config: Path | None = None):
    args = build_parser().parse_args(["serve", *argv])
    return load_settings(config, **serve_overrides(args))


def test_serve_flags_override_file_and_defaults(tmp_path: Path) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text("server:\n  port: 9100\n  admit_factor: 2.0\nengine:\n  max_model_len: 256\n")
    settings = _settings(["--port", "9200", "--home", str(tmp_path / "home"), "--model", "m",
                          "--role", "api", "--worker-url", "http://w1", "--worker-url", "http://w2"], config)
    assert settings.server.port == 9200 and settings.server.admit_factor == 2.0
    assert settings.engine.max_model_len == 256
    assert settings.home == (tmp_path / "home").resolve() and settings.model == "m"
    assert settings.server.role == "api" and settings.server.worker_urls == ["http://w1", "http://w2"]
    assert _settings([]).server.role == "embedded"
    worker = _settings(["--role", "worker", "--port", "9300", "--api-url", "http://api:9200"])
    assert worker.server.worker_port == 9300 and worker.server.api_url == "http://api:9200"


def test_public_host_without_keys_is_refused() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    check_exposure(_settings([]))
    with pytest.raises(InsecureExposure, match="SCALARLM_API_KEYS"):
        check_exposure(_settings(["--host", "0.0.0.0"]))
    check_exposure(_settings(["--host", "0.0.0.0", "--allow-insecure-public"]))
    check_exposure(load_settings(server={"host": "0.0.0.0", "api_keys": ["k"]}))


def test_generate_reports_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from scalarlm.cli.main import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    assert main(["generate", "hi", "--api-url", f"http://127.0.0.1:{port}", "--max-tokens", "2"]) == 1
    assert "cannot reach" in capsys.readouterr().err
