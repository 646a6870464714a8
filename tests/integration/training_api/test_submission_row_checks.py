"""Rows are checked in-process at submission (no child process): a bad row is a 400 naming its line and field,
for SFT and for GRPO jobs, and nothing is written."""

from __future__ import annotations

import subprocess

import pytest

from sdk_payloads import ROWS, post_train, sdk_archive  # helper module next to this file

SCORED = [{"prompt": "2+2=", "completion": "4", "reward": 1.0}, {"prompt": "2+2=", "completion": "5", "reward": 0.0}]


def _job_dirs(settings) -> list[str]:
    return sorted(p.name for p in settings.jobs_dir.iterdir()) if settings.jobs_dir.exists() else []


@pytest.fixture
def no_child_processes(monkeypatch):
    """Submission must not spawn a process to check rows: any subprocess.run during the request fails it."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"submission ran a child process: {args[:1]}")

    monkeypatch.setattr(subprocess, "run", refuse)


@pytest.mark.parametrize(
    ("rows", "params", "words"),
    [
        (ROWS[:1] + [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}]}],
         {"max_steps": 1}, ["dataset line 2", "field 'messages[1].content'"]),
        (SCORED + [{"prompt": "3+3=", "completion": "6"}], {"max_steps": 1, "loss": "grpo"},
         ["dataset line 3", "field 'reward'"]),
        (SCORED + [{"messages": [{"role": "bot", "content": "x"}], "completion": "6", "reward": 1}],
         {"max_steps": 1, "loss": "dr_grpo"}, ["dataset line 3", "field 'messages[0].role'"]),
    ],
)
def test_bad_row_is_400_naming_line_and_field(client, settings, no_child_processes, rows, params, words):
    response = post_train(client, sdk_archive(rows, with_ml=False), params)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message
    assert _job_dirs(settings) == []


def test_grpo_chat_prompts_are_accepted(client, settings, no_child_processes):
    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "completion": c, "reward": r}
            for c, r in (("4", 1.0), ("5", 0.0))]
    response = post_train(client, sdk_archive(rows, with_ml=False), {"max_steps": 1, "loss": "grpo"})
    assert response.status_code == 200, response.text
    assert response.json()["job_config"]["dataset_rows"] == 2


def test_chat_rows_on_a_model_without_a_chat_template_are_a_400(client, settings, tiny_model_dir, tmp_path):
    """The base (here a local directory named by llm_name) must ship a chat template for chat rows."""
    import json
    import shutil

    plain = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, plain, ignore=shutil.ignore_patterns("chat_template.*"))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    response = post_train(client, sdk_archive(ROWS[:1] + [chat], with_ml=False), {"llm_name": str(plain)})
    assert response.status_code == 400, response.text
    assert "dataset line 2: chat rows need a chat template" in response.json()["error"]["message"]
    assert _job_dirs(settings) == []
    ok = post_train(client, sdk_archive(ROWS[:1], with_ml=False), {"llm_name": str(plain), "max_steps": 1})
    assert ok.status_code == 200 and ok.json()["job_config"]["base_model"] == str(plain.resolve())
