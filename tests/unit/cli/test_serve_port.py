"""`scalarlm serve` binds its port before building the app, so the one Settings object (and the notify URL handed to
trainers) names the port really listened on, `--port 0` included."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from scalarlm.cli.serve import bind_listener, with_bound_port
from scalarlm.config import Settings
from scalarlm.launcher.base import notify_url


def test_port_zero_becomes_the_bound_port_in_settings(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, server={"role": "api", "port": 0})
    listener = bind_listener("127.0.0.1", 0)
    try:
        bound = with_bound_port(settings, listener.getsockname()[1])
        port = bound.server.port
        assert port > 0 and settings.server.port == 0  # a new Settings, the input is left alone
        assert notify_url(bound) == f"http://127.0.0.1:{port}"
        listener.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the URL trainers are told reaches this listener
        assert not listener.get_inheritable()  # trainers started later do not hold the port open
    finally:
        listener.close()


def test_a_taken_port_is_a_clear_exit(tmp_path: Path) -> None:
    taken = bind_listener("127.0.0.1", 0)
    taken.listen()
    try:
        with pytest.raises(SystemExit, match="cannot listen on 127.0.0.1"):
            bind_listener("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
