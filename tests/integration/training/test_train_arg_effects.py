"""Train args whose effect only a real job shows: LoRA dropout, the publish cadence beside the checkpoint cadence,
ScalarLM's `max_checkpoints_to_keep` and `max_token_block_size`. Two short LoRA jobs (real `python -m
scalarlm.training`) that differ in `lora_config.dropout` (the second also keeps only 2 checkpoints and publishes
bfloat16; neither changes the other's checks); the job list a user reads comes from the real control-plane routes
over the same home."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from trainer_jobs import losses, make_job, qa_rows, run_trainer, trainer_output

from scalarlm.checkpoint import JobDir
from scalarlm.config import Settings
from scalarlm.server.app import create_app

BLOCK = 32  # the QA rows fit; LONG_ROW does not (it would at the default max_seq_len, 512)
LONG_ROW = {"input": "Count: " + " ".join(str(n) for n in range(40)), "output": " and so on"}  # > BLOCK tokens
ARGS = dict(
    max_steps=5,
    learning_rate=1e-2,
    batch_size=4,
    adapter_type="lora",
    steps_per_checkpoint=3,  # resume state at 3 (and at the end)
    steps_per_publish=2,  # servable checkpoints at 2, 4 (and at the end)
    max_token_block_size=BLOCK,
    lr_schedule="constant",
    seed=0,
)
DROPOUT = 0.5


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


def _job(home: Path, name: str, model: Path, dropout: float, **more) -> JobDir:
    job = make_job(home / "jobs", name, model, qa_rows() + [LONG_ROW], **{**ARGS, **more},
                   lora_config={"r": 8, "alpha": 16, "dropout": dropout})  # fmt: skip
    assert run_trainer(job) == 0, trainer_output(job)
    return job


@pytest.fixture(scope="module")
def plain(home: Path, tiny_model_dir: Path) -> JobDir:
    return _job(home, "no-dropout", tiny_model_dir, 0.0)


@pytest.fixture(scope="module")
def dropped(home: Path, tiny_model_dir: Path) -> JobDir:
    return _job(home, "dropout", tiny_model_dir, DROPOUT, max_checkpoints_to_keep=2, publish_dtype="bfloat16")


def test_lora_dropout_changes_training_after_the_first_step_and_is_in_the_adapter_config(
    plain: JobDir, dropped: JobDir
) -> None:
    ours, ref = losses(dropped), losses(plain)
    # B starts at zero, so the first forward is the base model's either way; the dropped inputs change its gradients.
    assert ours[0] == pytest.approx(ref[0], abs=1e-6), (ours, ref)
    assert all(abs(a - b) > 1e-4 for a, b in zip(ours[1:], ref[1:])), (ours, ref)
    for job, dropout in ((dropped, DROPOUT), (plain, 0.0)):
        config = json.loads((job.step_dir(5) / "adapter_config.json").read_text())
        assert config["lora_dropout"] == dropout


def test_checkpoints_are_published_every_steps_per_publish_and_state_saved_every_steps_per_checkpoint(
    home: Path, plain: JobDir
) -> None:
    settings = Settings(home=home, model=str(plain.read_config().base_model), server={"role": "api"})
    with TestClient(create_app(settings)) as client:
        body = client.get(f"/v1/megatron/train/{plain.job_id}").json()
        listed = client.get(f"/v1/megatron/train/{plain.job_id}/checkpoints").json()
    assert body["job_status"]["status"] == "COMPLETED" and body["checkpoints"] == [2, 4, 5], body
    assert [c["step"] for c in listed["checkpoints"]] == [2, 4, 5], listed
    log = (plain.logs_dir / "rank-0.log").read_text()
    saved = [int(line.rsplit(" ", 1)[1]) for line in log.splitlines() if "saved resume state at step" in line]
    assert saved == [3, 5], saved


def test_max_checkpoints_to_keep_leaves_the_newest_published_steps(
    home: Path, plain: JobDir, dropped: JobDir
) -> None:
    """ScalarLM's `max_checkpoints_to_keep`: the job published at 2, 4 and 5 and kept the newest two (the same job
    without it keeps all three); the served and exported step is the newest."""
    settings = Settings(home=home, model=str(plain.read_config().base_model), server={"role": "api"})
    with TestClient(create_app(settings)) as client:
        kept = client.get(f"/v1/megatron/train/{dropped.job_id}").json()["checkpoints"]
        removed = client.get(f"/v1/megatron/train/{dropped.job_id}/export?step=2")
    assert kept == [4, 5]
    assert sorted(p.name for p in dropped.checkpoints_dir.iterdir()) == ["latest", "step-4", "step-5"]
    assert removed.status_code == 404, removed.text
    assert "removed steps [2] (max_checkpoints_to_keep 2)" in (dropped.logs_dir / "rank-0.log").read_text()


def test_publish_dtype_is_the_adapters_dtype(plain: JobDir, dropped: JobDir) -> None:
    """A LoRA adapter is published in float32 ("source", PEFT's default) unless `publish_dtype` names another."""
    from safetensors import safe_open

    for job, dtype in ((plain, "F32"), (dropped, "BF16")):
        with safe_open(job.step_dir(5) / "adapter_model.safetensors", "pt") as f:
            dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
        assert dtypes == {dtype}, (job.job_id, dtypes)


def test_max_token_block_size_is_the_block_length(plain: JobDir) -> None:
    data = plain.read_status().details["data"]
    assert data["max_seq_len"] == BLOCK and data["truncated_rows"] == 1, data  # LONG_ROW is cut to the block
    assert plain.read_config().train_args.max_seq_len == BLOCK
    metrics = plain.read_metrics()
    assert all(m["tokens"] <= ARGS["batch_size"] * BLOCK for m in metrics), [m["tokens"] for m in metrics]
