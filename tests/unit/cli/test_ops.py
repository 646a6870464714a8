"""The operator CLI's parsing and formatting, without a server (the commands run against one in
tests/integration/console/test_cli.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from scalarlm.cli.main import build_parser, main
from scalarlm.cli.ops import _train_args, progress, run_ls, run_squeue, smooth, table
from scalarlm.protocol.training import MAX_STEPS


def test_table_aligns_columns_and_formats_cells() -> None:
    out = table(["model", "loss"], [["job-a", 0.123456], ["b", None]]).splitlines()
    assert out == ["MODEL  LOSS", "job-a  0.1235", "b      -"]


def test_an_open_ended_session_shows_its_step_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert progress(2, 4) == "2/4" and progress(None, 4) == "0/4"
    assert progress(2, MAX_STEPS) == "2" and progress(3, None) == "3"

    class Listing:  # what the server's list_models and squeue answer, for the tables alone
        def list_models(self) -> dict:
            return {"models": [{"name": "session-a", "status": "RUNNING", "step": 2, "max_steps": MAX_STEPS},
                               {"name": "job-b", "status": "COMPLETED", "step": 4, "max_steps": 4}]}

        def squeue(self) -> dict:
            return {"jobs": [{"job_id": "session-a", "status": "RUNNING", "state": "1 running", "step": 2,
                              "max_steps": MAX_STEPS}]}

    args = argparse.Namespace(json=False, all=False)
    run_ls(Listing(), args)  # type: ignore[arg-type]
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[:3] for row in rows] == [["session-a", "RUNNING", "2"], ["job-b", "COMPLETED", "4/4"]]
    run_squeue(Listing(), args)  # type: ignore[arg-type]
    assert capsys.readouterr().out.splitlines()[1].split()[-2:] == ["2", "-"]


def test_smooth_is_a_trailing_moving_average() -> None:
    assert smooth([1.0, 3.0, 5.0, 7.0], 1) == [1.0, 3.0, 5.0, 7.0]
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_train_args_from_json_or_a_file(tmp_path: Path) -> None:
    ns = argparse.Namespace(train_args='{"max_steps": 3}', train_args_file=None)
    assert _train_args(ns) == {"max_steps": 3}
    (tmp_path / "a.json").write_text('{"learning_rate": 0.1}')
    assert _train_args(argparse.Namespace(train_args=None, train_args_file=str(tmp_path / "a.json"))) == {
        "learning_rate": 0.1}
    with pytest.raises(ValueError, match="JSON object"):
        _train_args(argparse.Namespace(train_args="[1]", train_args_file=None))


def test_every_operator_command_parses() -> None:
    parser = build_parser()
    for argv in (["ls", "-A", "--json"], ["models"], ["logs", "J", "--follow"], ["plot", "J", "-o", "x.png", "--smooth",
                 "5"], ["squeue"], ["stats"], ["cancel", "J"], ["resume", "J"], ["delete", "J"], ["clear-queue"],
                 ["train", "d.jsonl", "--train-args", "{}", "--wait"], ["export", "J", "--merged", "-o", "D"]):  # fmt: skip
        assert callable(parser.parse_args(argv).func)
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "d.jsonl", "--train-args", "{}", "--train-args-file", "f"])


def test_an_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--api-url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("scalarlm: cannot reach http://127.0.0.1:9") and err.count("\n") == 1


def test_push_to_hub_without_a_token_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scalarlm.cli.ops import push_to_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ValueError, match="needs a token"):
        push_to_hub(tmp_path, "me/model", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        push_to_hub(tmp_path, "me/model", "tok")
