"""The web console at /app in Debian's headless Chromium, driven over the DevTools protocol against a real server with
API keys on: nothing shows without a key, a wrong key is refused, and with the key a job trains while its curve
grows, its logs open, and a playground prompt comes back with its model and version. Screenshots: build/console/."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cdp import Browser, chromium_path
from console_server import ROWS, Server

from scalarlm.protocol.training import MAX_STEPS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
SHOTS = REPO / "build" / "console"
# Every API route the console calls (the job routes with a job id filled in).
CONSOLE_ROUTES = ["/v1/megatron/list_models", "/v1/generate/workers", "/v1/generate/metrics", "/v1/megatron/squeue",
                  "/v1/megatron/train/{job}", "/v1/megatron/train/{job}/metrics", "/v1/megatron/train/{job}/logs",
                  "/v1/megatron/train/{job}/checkpoints", "/v1/megatron/train/{job}/dataset",
                  "/v1/megatron/train/{job}/dataset/download"]  # fmt: skip
ASSETS = ["/app/", "/app/static/console.js", "/app/static/console.css"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    binary = chromium_path()
    if binary is None:
        pytest.fail("chromium is not installed: run scripts/install.sh (it installs Debian's chromium)")
    b = Browser(binary, tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield b
    finally:
        b.close()


def test_pages_and_api_leak_nothing_without_a_key(server: Server, lora_job: str) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path in ASSETS:
            page = http.get(path)
            assert page.status_code == 200, path
            assert lora_job not in page.text and server.key not in page.text
            text = page.text.replace("http://www.w3.org/2000/svg", "")  # SVG's namespace name, never fetched
            assert "http://" not in text and "https://" not in text and "//cdn" not in text  # nothing from outside
        assert "default-src 'self'" in http.get("/app/").headers["content-security-policy"]
        assert http.get("/app/static/..%2fconsole.py").status_code == 404
        for route in CONSOLE_ROUTES:
            path = route.format(job=lora_job)
            for headers in ({}, {"Authorization": "Bearer wrong-key"}):
                answer = http.get(path, headers=headers)
                assert answer.status_code == 401, (path, headers, answer.text)
                assert lora_job not in answer.text and "loss" not in answer.text
        for route, body in (("/v1/completions", {"model": lora_job, "prompt": "hi"}),
                            ("/v1/chat/completions", {"model": lora_job, "messages": []})):  # fmt: skip
            assert http.post(route, json=body).status_code == 401


def _state(b: Browser) -> str:
    return b.eval("document.body.dataset.state || ''")


def test_console_in_chromium(server: Server, lora_job: str, browser: Browser) -> None:
    b = browser
    logged_in_at = 0
    b.open(f"{server.url}/app/")
    b.wait_for("document.body.dataset.state === 'login'")
    assert b.eval("document.getElementById('view').children.length") == 0
    assert b.eval("document.getElementById('nav').hidden") is True
    assert lora_job not in b.eval("document.body.innerText")
    b.screenshot(SHOTS / "0-login.png")

    b.type("#key", "wrong-key")
    b.click("#login-form button")
    refused = b.wait_for("!document.getElementById('login-error').hidden && document.getElementById('login-error').textContent")
    assert refused == "Refused: invalid API key" and _state(b) == "login"
    assert lora_job not in b.eval("document.body.innerText")

    # A job starts training; the console, logged in, sees its curve grow. It runs until it is deleted below, so
    # a slow login cannot find it already finished.
    with server.client() as llm:
        job = llm.train(ROWS, train_args={"max_steps": 100_000, "learning_rate": 1e-3, "steps_per_publish": 100_000})
    try:
        logged_in_at = len(b.requests)
        b.type("#key", server.key)
        b.click("#login-form button")
        b.wait_for(f"document.body.dataset.state === 'app' && document.querySelector('#jobs-table tr[data-job=\"{job.id}\"]')")
        grown = []
        for _ in range(2):
            floor = grown[-1] if grown else 0
            grown.append(int(b.wait_for(
                f"(() => {{ const c = document.querySelector('#loss-chart'); const n = c ? +c.dataset.points : 0; "
                f"return n > {floor} ? n : 0; }})()", timeout=180)))  # fmt: skip
        assert grown[1] > grown[0] >= 1, grown
        assert b.eval(f"document.querySelector('#jobs-table tr[data-job=\"{job.id}\"] .status').textContent") == "RUNNING"
        step_cell = b.eval(f"document.querySelector('#jobs-table tr[data-job=\"{job.id}\"]').children[2].textContent")
        assert re.fullmatch(r"\d+ / 100000", step_cell), step_cell
        # an open-ended RL session (max_steps at the protocol's ceiling) shows its step alone
        assert b.eval("MAX_STEPS") == MAX_STEPS
        assert b.eval(f"[progress(2, {MAX_STEPS}), progress(2, 4), progress(null, null)]") == ["2", "2 / 4", "0"]
        b.screenshot(SHOTS / "1-jobs.png")

        b.click(f"#jobs-table tr[data-job=\"{job.id}\"] a")
        b.wait_for(f"document.getElementById('job-id') && document.getElementById('job-id').textContent === '{job.id}'")
        b.wait_for("+document.querySelector('#loss-chart').dataset.points > 0")
        b.screenshot(SHOTS / "2-job.png")

        b.click("#logs-link")
        logs = b.wait_for("document.getElementById('logs') && /step \\d+ loss/.test(document.getElementById('logs').textContent) "
                          "&& document.getElementById('logs').textContent", timeout=60)  # fmt: skip
        assert re.search(rf"job {job.id}", logs) or "step" in logs
        b.screenshot(SHOTS / "3-logs.png")
    finally:
        with server.client() as llm:
            llm.delete(job.id)

    b.click("#nav a[data-view='models']")
    b.wait_for(f"document.querySelector('#models-table tr[data-model=\"{lora_job}\"]')")
    assert b.eval(f"document.querySelector('#models-table tr[data-model=\"{lora_job}\"]').innerText").split("\t")[1:3] == [
        "lora", "4"]
    b.screenshot(SHOTS / "4-models.png")

    b.click("#nav a[data-view='queue']")
    b.wait_for("document.querySelector('#queue-table') && +document.querySelector('#depth-chart').dataset.points >= 2",
               timeout=30)
    b.screenshot(SHOTS / "5-queue.png")

    b.click("#nav a[data-view='playground']")
    b.wait_for(f"document.querySelector('#pg-model option[value=\"{lora_job}\"]')")
    b.eval(f"document.getElementById('pg-model').value = '{lora_job}'")
    b.type("#pg-prompt", "What is 3 + 1?")
    b.click("#pg-send")
    b.wait_for("!document.getElementById('pg-result').hidden || !document.getElementById('pg-error').hidden", timeout=120)
    assert b.eval("document.getElementById('pg-error').hidden"), b.eval("document.getElementById('pg-error').textContent")
    assert b.eval("document.getElementById('pg-model-out').textContent") == lora_job
    assert b.eval("document.getElementById('pg-version-out').textContent") == "4"
    assert b.eval("document.getElementById('pg-answer').textContent")
    b.screenshot(SHOTS / "6-playground.png")

    # Every API call the page made after the login carried the key, as the client sends it.
    api_calls = [r for r in b.requests[logged_in_at:] if "/v1/" in r["url"]]
    assert len(api_calls) > 10
    assert all(r["headers"].get("Authorization") == f"Bearer {server.key}" for r in api_calls), api_calls[:3]
    assert not [r for r in b.requests if not r["url"].startswith((server.url, "about:", "data:", "blob:"))]

    b.click("#logout")
    b.wait_for("document.body.dataset.state === 'login'")
    assert lora_job not in b.eval("document.body.innerText")
