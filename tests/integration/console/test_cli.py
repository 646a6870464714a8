"""The operator CLI against a real server (API keys on): each command's table, its `--json`, exit codes, and the one
line a bad job id, a missing or wrong key, or a bad train arg prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from console_server import Server

from scalarlm.cli.main import main

pytestmark = pytest.mark.slow


def cli(server: Server, capsys: pytest.CaptureFixture[str], *argv: str, key: str | None = "default") -> tuple[int, str, str]:
    """Run `scalarlm ARGV` in this process against the server; (exit status, stdout, stderr)."""
    capsys.readouterr()
    auth = ["--api-key", server.key if key == "default" else key] if key else []
    rc = main([argv[0], "--api-url", server.url, *auth, *argv[1:]])
    out = capsys.readouterr()
    return rc, out.out, out.err


def cli_json(server: Server, capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    rc, out, err = cli(server, capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_missing_and_wrong_keys_are_one_line_and_exit_1(server: Server) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SCALARLM_API_KEY"}
    env["SCALARLM_API_URL"] = server.url  # the client's resolution: no --api-url needed
    for extra, expected in (([], "missing API key"), (["--api-key", "wrong"], "invalid API key")):
        done = subprocess.run([sys.executable, "-m", "scalarlm.cli", "ls", *extra], capture_output=True, text=True,
                              env=env, timeout=60)  # fmt: skip
        assert done.returncode == 1
        assert done.stdout == ""
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("scalarlm: Unauthorized: "), done.stderr
        assert expected in done.stderr
    done = subprocess.run([sys.executable, "-m", "scalarlm.cli", "ls"], capture_output=True, text=True, timeout=60,
                          env={**env, "SCALARLM_API_KEY": server.key})  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("MODEL"), done.stderr


def test_train_wait_then_ls_models_logs_plot(server: Server, trained: dict[str, Any], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    # `trained` ran `scalarlm train DATA --train-args-file F --wait --json`
    assert trained["status"] == "COMPLETED" and trained["step"] == 4 and trained["loss"] > 0, trained
    job = trained["job_id"]

    rc, out, _ = cli(server, capsys, "ls")
    assert rc == 0
    header, *rows = out.splitlines()
    assert header.split() == ["MODEL", "STATUS", "STEP", "LOSS", "VERSION", "KIND", "STARTED"]
    row = next(r for r in rows if r.startswith(job)).split()
    assert row[1:3] == ["COMPLETED", "4/4"] and row[4:6] == ["4", "lora"]
    assert not any(r.startswith("tiny ") for r in rows)  # the base model only with -A
    listed = cli_json(server, capsys, "ls", "-A")
    assert isinstance(listed, list) and listed[-1]["name"] == "tiny" and any(m["name"] == job for m in listed)

    models = cli_json(server, capsys, "models")
    assert {"name": job, "version": 4, "kind": "lora"}.items() <= next(m for m in models if m["name"] == job).items()
    rc, out, _ = cli(server, capsys, "models")
    assert rc == 0 and out.splitlines()[0].split() == ["MODEL", "KIND", "VERSION", "STATUS"]

    rc, out, _ = cli(server, capsys, "logs", job)
    assert rc == 0 and f"job {job}: completed at step 4" in out
    rc, followed, _ = cli(server, capsys, "logs", job, "--follow")  # a finished job: the whole log, then exit
    assert rc == 0 and followed.startswith(out)

    png = tmp_path / "curve.png"
    assert cli_json(server, capsys, "plot", job, "-o", str(png), "--smooth", "3") == {"path": str(png), "points": 4}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_squeue_cancel_resume_delete(server: Server, dataset_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(server, capsys, "train", str(dataset_file), "--train-args", '{"max_steps": 5000}')
    assert rc == 0, err
    job = out.split(":")[0]
    queued = cli_json(server, capsys, "squeue")
    assert isinstance(queued, list)
    entry = next(j for j in queued if j["job_id"] == job)
    assert entry["launcher"] == "local" and entry["launcher_id"] and entry["status"] in ("QUEUED", "RUNNING")
    rc, out, _ = cli(server, capsys, "squeue")
    assert out.splitlines()[0].split()[:4] == ["JOB", "STATUS", "LAUNCHER", "LAUNCHER_ID"] and job in out

    rc, out, _ = cli(server, capsys, "cancel", job)
    assert rc == 0 and out.startswith(f"{job}: ") and out.count("\n") == 1, out
    with server.client() as llm:
        assert llm.get_training_job(job).wait(timeout=120, progress=False).status == "CANCELLED"
    assert all(j["job_id"] != job for j in cli_json(server, capsys, "squeue"))  # type: ignore[union-attr]
    resumed = cli_json(server, capsys, "resume", job)
    assert isinstance(resumed, dict) and resumed["status"] in ("QUEUED", "RUNNING") and resumed["resumes"] == 1
    rc, out, _ = cli(server, capsys, "delete", job)
    assert rc == 0 and out.strip() == f"{job}: deleted"
    rc, out, err = cli(server, capsys, "logs", job)
    assert rc == 1 and out == "" and err == f"scalarlm: NotFound: training job '{job}' does not exist\n"


def test_stats_and_clear_queue(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    with server.client() as llm:
        llm.generate(["Hello"], max_tokens=4)
    stats = cli_json(server, capsys, "stats")
    assert isinstance(stats, dict) and stats["health"]["all"] == "up"
    assert stats["queue"]["total_completed"] >= 1 and stats["workers"][0]["loaded"].get("tiny") == 0
    rc, out, _ = cli(server, capsys, "stats")
    assert rc == 0 and "QUEUED" in out and "WORKER" in out
    rc, out, _ = cli(server, capsys, "clear-queue")
    assert rc == 0 and out.startswith("cleared ")


def test_bad_requests_are_one_line(server: Server, dataset_file: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    for argv in (["logs", "job-nope"], ["plot", "job-nope"], ["cancel", "job-nope"], ["export", "job-nope", "-o",
                 str(tmp_path / "x")]):  # fmt: skip
        rc, out, err = cli(server, capsys, *argv)
        assert rc == 1 and out == ""
        assert err == "scalarlm: NotFound: training job 'job-nope' does not exist\n", (argv, err)
    rc, _, err = cli(server, capsys, "train", str(dataset_file), "--train-args", '{"max_stepz": 3}')
    assert rc == 1 and err == "scalarlm: InvalidRequest: unknown train arg 'max_stepz'\n"
    rc, _, err = cli(server, capsys, "train", str(dataset_file), "--train-args", "{nope")
    assert rc == 1 and err.startswith("scalarlm: train args are not valid JSON") and err.count("\n") == 1
    rc, _, err = cli(server, capsys, "ls", key=None)
    assert rc == 1 and err.startswith("scalarlm: Unauthorized: missing API key")


def test_export_to_a_directory_and_hub_push_refused_without_a_token(
    server: Server, lora_job: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = cli_json(server, capsys, "export", lora_job, "-o", str(tmp_path / "adapter"))
    assert isinstance(adapter, dict) and adapter["kind"] == "lora" and adapter["step"] == 4
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(adapter["files"])
    merged = cli_json(server, capsys, "export", lora_job, "--merged", "--step", "2", "-o", str(tmp_path / "merged"))
    assert isinstance(merged, dict) and merged["kind"] == "full" and merged["step"] == 2
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(merged["files"])
    assert not list((tmp_path / "merged").glob(".export-*"))  # the download's scratch space is gone

    monkeypatch.delenv("HF_TOKEN", raising=False)
    rc, _, err = cli(server, capsys, "export", lora_job, "-o", str(tmp_path / "hub"), "--push-to-hub", "me/model")
    assert rc == 1 and err.startswith("scalarlm: --push-to-hub needs a token") and err.count("\n") == 1
    assert (tmp_path / "hub" / "adapter_model.safetensors").exists()  # the export itself is kept
