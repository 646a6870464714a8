"""The client's training API against a real uvicorn control plane: train, wait, metrics, cancel, plot."""

from __future__ import annotations

import json

import pytest

from scalarlm.client import AsyncScalarLM, ScalarLM, TrainingFailed
from scalarlm.protocol.errors import InvalidRequest, NotFound

from sdk_payloads import ROWS  # helper module next to this file

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_train_wait_metrics_plot_and_list(live_url, tmp_path):
    with ScalarLM(live_url) as llm:
        job = llm.train(ROWS, train_args={"max_steps": 3, "learning_rate": 1e-3})
        assert job["job_status"]["job_id"] == job.id  # ScalarLM-style dict access still works

        final = job.wait(timeout=120, poll_seconds=0.1)
        assert (final.status, final.step) == ("COMPLETED", 3)
        assert job.status().status == "COMPLETED"
        assert [m["step"] for m in job.metrics()] == [1, 2, 3]

        png = llm.plot(job, tmp_path / "plots" / "loss.png")
        assert png.read_bytes().startswith(PNG_SIGNATURE)
        assert job.plot(tmp_path / "again.png").stat().st_size > 1000

        again = llm.get_training_job(job.id)
        assert again["job_status"]["status"] == "COMPLETED"
        assert [h["loss"] for h in again["job_status"]["history"]] == [4.0, 2.0, 4.0 / 3]
        names = [m["name"] for m in llm.list_models()["models"]]
        assert job.id in names


def test_large_dataset_from_a_jsonl_path_goes_in_chunks(live_url, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i} " * 20, "completion": f"c{i}"}) + "\n" for i in range(200)))
    with ScalarLM(live_url) as llm:
        job = llm.train(str(path), train_args={"max_steps": 3}, single_post_threshold=0, chunk_size=1024)
        assert job["job_config"]["dataset_rows"] == 200
        assert job.wait(timeout=120, poll_seconds=0.1).status == "COMPLETED"


def test_wait_raises_with_the_reason_when_the_trainer_dies(live_url):
    with ScalarLM(live_url) as llm:
        job = llm.train(ROWS, train_args={"max_steps": 13})
        with pytest.raises(TrainingFailed) as failed:
            job.wait(timeout=120, poll_seconds=0.1)
    assert failed.value.job_id == job.id
    assert "exited with code 1 without a final status" in failed.value.reason
    assert "ValueError: loss is NaN at step 2" in failed.value.reason


def test_cancel_and_delete_from_the_client(live_url):
    with ScalarLM(live_url) as llm:
        job = llm.train(ROWS, train_args={"max_steps": 1_000_000})
        assert job.cancel().status == "CANCELLED"
        assert job.wait(timeout=60, poll_seconds=0.1).status == "CANCELLED"
        job.delete()
        with pytest.raises(NotFound):
            llm.get_training_job(job.id)


def test_bad_args_and_unknown_jobs_raise_typed_errors(live_url):
    with ScalarLM(live_url) as llm:
        with pytest.raises(InvalidRequest, match="unknown train arg 'epochs'"):
            llm.train(ROWS, train_args={"epochs": 3})
        with pytest.raises(InvalidRequest, match="dataset line 2"):
            llm.train([ROWS[0], {"input": 1, "output": "x"}])
        with pytest.raises(NotFound):
            llm.get_training_job("job-does-not-exist")


async def test_async_client_trains_and_plots(live_url, tmp_path):
    llm = AsyncScalarLM(live_url)
    job = await llm.train(ROWS, model_name=None, train_args={"max_steps": 3})
    assert (await job.wait(timeout=120, poll_seconds=0.1)).status == "COMPLETED"
    assert len(await job.metrics()) == 3
    assert (await llm.plot(job.id, tmp_path / "loss.png")).read_bytes().startswith(PNG_SIGNATURE)
