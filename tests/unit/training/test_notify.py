"""Published notices: nothing without $SCALARLM_NOTIFY_URL; an unreachable control plane is logged, not raised."""

from __future__ import annotations

import socket

from scalarlm.training.notify import notify_published


def test_no_url_sends_nothing() -> None:
    assert notify_published("job-1", 3, environ={}) is False


def test_unreachable_control_plane_is_best_effort() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connection refused
    assert notify_published("job-1", 3, environ={"SCALARLM_NOTIFY_URL": f"http://127.0.0.1:{port}"}) is False
