"""A real control-plane process (uvicorn, role api) is SIGKILLed with items queued and leased,
restarted on the same home, and every item completes exactly once through the HTTP worker routes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

SERVER = textwrap.dedent(
    """
    import sys, uvicorn
    from scalarlm.config import load_settings
    from scalarlm.server import create_app
    settings = load_settings(
        home=sys.argv[1], model="no-such-dir/tiny", served_model_name="tiny",
        server={"role": "api", "port": int(sys.argv[2])}, generate={"lease_seconds": 2.0},
    )
    uvicorn.run(create_app(settings), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(home: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(home), str(port)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up")


def _results(items: list[dict]) -> dict:
    return {"results": [{"request_id": i["request_id"], "model": i["model"], "outputs": [{"text": "done:" + i["prompt"]}]}
                        for i in items]}


def test_sigkill_and_restart_completes_every_item_exactly_once(tmp_path: Path) -> None:
    home, port = tmp_path / "home", _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(home, port)
    try:
        rows = json.dumps([{"prompt": f"p{i}", "model": None, "max_tokens": None, "request_type": "generate"}
                           for i in range(2000)]).encode()
        batch = httpx.post(f"{url}/v1/generate/upload", files={"file": ("r.json", rows)}, timeout=60).json()
        small = httpx.post(f"{url}/v1/generate", json={"prompts": ["x", "y"]}, timeout=60).json()["results"]
        leased = httpx.post(f"{url}/v1/generate/get_work", json={"worker_id": "old", "capacity": 300}, timeout=60).json()
        assert len(leased["requests"]) == 300
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    proc = _start(home, port)
    try:
        counts = httpx.get(f"{url}/v1/generate/metrics", timeout=30).json()["queue"]
        assert (counts["queued"], counts["leased"]) == (1702, 300)
        # The old worker survived the control plane and posts some of its results late: they still count.
        late = httpx.post(f"{url}/v1/generate/finish_work", json=_results(leased["requests"][:100]), timeout=60).json()
        assert late == {"accepted": 100, "duplicates": 0}
        accepted = 100
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            work = httpx.post(f"{url}/v1/generate/get_work", json={"worker_id": "new", "capacity": 500}, timeout=60).json()
            if work["requests"]:
                accepted += httpx.post(f"{url}/v1/generate/finish_work", json=_results(work["requests"]), timeout=60).json()["accepted"]
            elif accepted >= 2002:
                break
        # ...and the rest of its results arrive after the new worker redid them: ignored.
        dup = httpx.post(f"{url}/v1/generate/finish_work", json=_results(leased["requests"][100:]), timeout=60).json()
        assert dup == {"accepted": 0, "duplicates": 200}
        assert accepted == 2002

        final = httpx.post(f"{url}/v1/generate/download", json={"request_id": batch["request_id"]}, timeout=60).json()
        assert final["current_index"] == final["total_requests"] == 2000
        assert all(r["response"] == f"done:p{int(k.rsplit('_', 1)[1])}" for k, r in final["results"].items())
        got = httpx.post(f"{url}/v1/generate/get_results", json={"request_ids": [r["request_id"] for r in small]},
                         timeout=60).json()
        assert [r["response"] for r in got["results"]] == ["done:x", "done:y"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
