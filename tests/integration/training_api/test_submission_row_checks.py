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
        # one completion per prompt: every advantage is 0 and, with no KL term, nothing would train
        ([SCORED[0], {"prompt": "3+3=", "completion": "6", "reward": 1.0}], {"max_steps": 1},
         ["dataset: every group holds one completion (2 rows in 2 groups)", "kl_coef > 0"]),
    ],
)
def test_bad_row_is_400_naming_line_and_field(client, settings, no_child_processes, rows, params, words):
    response = post_train(client, sdk_archive(rows, with_ml=False), params)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message
    assert _job_dirs(settings) == []


def test_groups_of_one_train_with_a_kl_term(client, settings, no_child_processes):
    rows = [SCORED[0], {"prompt": "3+3=", "completion": "6", "reward": 1.0}]
    response = post_train(client, sdk_archive(rows, with_ml=False), {"max_steps": 1, "kl_coef": 0.1})
    assert response.status_code == 200, response.text
    assert response.json()["job_config"]["dataset_rows"] == 2


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


def test_scored_rows_train_grpo_unless_the_job_names_its_loss(client, settings, no_child_processes):
    """`llm.train(rows_with_rewards)`: rows with a `reward` and no `loss` train GRPO; loss 'sft', which would train
    on every completion whatever its reward, refuses them naming the fix."""
    response = post_train(client, sdk_archive(SCORED, with_ml=False), {"max_steps": 1})
    assert response.status_code == 200, response.text
    assert response.json()["job_config"]["train_args"]["loss"] == "grpo"
    jobs = _job_dirs(settings)
    sft = post_train(client, sdk_archive(SCORED, with_ml=False), {"max_steps": 1, "loss": "sft"})
    assert sft.status_code == 400, sft.text
    message = sft.json()["error"]["message"]
    assert message.startswith("dataset line 1: field 'reward' is for an RL loss") and "loss 'grpo'" in message
    plain = post_train(client, sdk_archive(ROWS, with_ml=False), {"max_steps": 1})
    assert plain.status_code == 200 and plain.json()["job_config"]["train_args"]["loss"] == "sft"
    # GRPO's own settings are taken with scored rows, and refused with SFT rows, when no loss is named.
    mu = post_train(client, sdk_archive(SCORED, with_ml=False), {"max_steps": 1, "num_iterations": 2})
    assert mu.status_code == 200 and mu.json()["job_config"]["train_args"]["num_iterations"] == 2, mu.text
    sft_mu = post_train(client, sdk_archive(ROWS, with_ml=False), {"max_steps": 1, "num_iterations": 2})
    assert sft_mu.status_code == 400 and "num_iterations and routing_replay are GRPO settings" in sft_mu.text
    assert len(_job_dirs(settings)) == len(jobs) + 2


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"lora_config": {"r": 32}}, ["lora_config.r 32 is above this server's engine.max_lora_rank 16"]),
        ({"nodes": 2}, ["nodes 2: the local launcher runs a job's ranks on this one node"]),
    ],
)
def test_a_job_the_server_could_never_run_or_serve_is_a_400(client, settings, params, words):
    response = post_train(client, sdk_archive(ROWS, with_ml=False), {"max_steps": 1, **params})
    assert response.status_code == 400, response.text
    for word in words:
        assert word in response.json()["error"]["message"]
    assert _job_dirs(settings) == []
    full = post_train(client, sdk_archive(ROWS, with_ml=False), {"max_steps": 1, "adapter_type": "full",
                                                                 "lora_config": {"r": 32}})  # fmt: skip
    assert full.status_code == 200, full.text  # the rank of an adapter that is not trained does not matter


def test_a_job_wanting_more_gpus_than_the_node_has_is_a_400_not_a_wait(settings, tmp_path):
    """On a GPU node it would wait for ever for GPUs that do not exist, holding back every job after it."""
    from fastapi.testclient import TestClient

    from scalarlm.launcher import LocalLauncher
    from scalarlm.server.app import create_app
    from scalarlm.server.jobs import TrainingJobs

    gpu_node = settings.model_copy(update={"training": settings.training.model_copy(update={"gpus_per_node": 2})})
    app = create_app(gpu_node)
    app.state.training = TrainingJobs(gpu_node, {"local": LocalLauncher(gpu_node, entry=["/bin/false"])})
    with TestClient(app) as client:
        response = post_train(client, sdk_archive(ROWS, with_ml=False), {"max_steps": 1, "gpus": 4})
    assert response.status_code == 400, response.text
    assert "gpus 4 exceeds the 2 GPUs of this node (training.gpus_per_node)" in response.json()["error"]["message"]
    assert _job_dirs(gpu_node) == []
