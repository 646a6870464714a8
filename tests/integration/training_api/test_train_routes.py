"""Training routes against the real app: ScalarLM-SDK-shaped submissions, validation (400), 404, control."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import textwrap

import pytest
from fastapi.testclient import TestClient

from scalarlm.checkpoint import JobDir
from scalarlm.launcher import LaunchRecord, LocalLauncher
from scalarlm.launcher.base import write_record
from scalarlm.protocol.training import JobStatus, TrainArgs, TrainJobConfig
from scalarlm.server.app import create_app
from scalarlm.server.jobs import TrainingJobs

from sdk_payloads import ROWS, STAND_IN_TRAINER, post_train, sdk_archive  # helper module next to this file


def error_of(response) -> dict:
    return response.json()["error"]


def job_dirs(settings) -> list[str]:
    return sorted(p.name for p in settings.jobs_dir.iterdir()) if settings.jobs_dir.exists() else []


def test_sdk_shaped_submission_trains_and_reports(client, settings, wait_status):
    response = post_train(client, sdk_archive(), {"max_steps": 3, "learning_rate": 1e-3, "gpus": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    status, config = body["job_status"], body["job_config"]
    job_id = status["job_id"]
    assert job_id.startswith("job-") and status["model_name"] == job_id
    assert status["status"] in ("QUEUED", "RUNNING", "COMPLETED")
    assert config["train_args"]["max_steps"] == 3 and config["dataset_rows"] == len(ROWS)
    assert config["base_model"] == str(settings.model)
    job_root = settings.jobs_dir / job_id
    assert status["job_directory"] == str(job_root)
    assert [json.loads(line) for line in (job_root / "dataset.jsonl").read_text().splitlines()] == ROWS
    assert not (job_root / "ml").exists()  # bundled code is ignored, never extracted

    final = wait_status(client, job_id)
    assert final["job_status"]["status"] == "COMPLETED", final
    assert [h["step"] for h in final["job_status"]["history"]] == [1, 2, 3]
    assert final["metrics_count"] == 3 and final["last_metrics"]["step"] == 3

    metrics = client.get(f"/v1/megatron/train/{job_id}/metrics").json()
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[0]["loss"] == 4.0
    assert "stand-in trainer rank 0" in client.get(f"/v1/megatron/train/{job_id}/logs").text

    models = client.get("/v1/megatron/list_models").json()["models"]
    assert models[-1]["name"] == settings.base_model_name and models[-1]["kind"] == "base"
    (entry,) = [m for m in models if m["name"] == job_id]
    assert entry["status"] == "COMPLETED" and entry["step"] == 3 and entry["max_steps"] == 3
    assert entry["kind"] == "lora" and entry["deployed"] is False  # no checkpoint was published


def test_latest_names_the_newest_job_in_reads_and_logs_stream_as_numbered_lines(client, settings, wait_status):
    """ScalarLM's SDK CLI reads `latest` (its default for `logs` and `plot`) and streams logs as JSON lines."""
    assert client.get("/v1/megatron/train/latest").status_code == 404  # no job yet: 'latest' names none
    first = post_train(client, sdk_archive(), {"max_steps": 2}).json()["job_status"]["job_id"]
    second = post_train(client, sdk_archive(), {"max_steps": 3}).json()["job_status"]["job_id"]
    for job_id in (first, second):
        assert wait_status(client, job_id)["job_status"]["status"] == "COMPLETED"
    assert client.get("/v1/megatron/train/latest").json()["job_status"]["job_id"] == second
    assert [m["step"] for m in client.get("/v1/megatron/train/latest/metrics").json()] == [1, 2, 3]

    whole = client.get(f"/v1/megatron/train/{second}/logs").text.splitlines(keepends=True)
    streamed = client.get("/v1/megatron/train/logs/latest", params={"starting_line_number": 1})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert lines == [{"line_number": i, "line": line} for i, line in enumerate(whole) if i >= 1] and len(whole) > 1
    assert client.get(f"/v1/megatron/train/logs/{first}").text != streamed.text
    assert client.get("/v1/megatron/train/logs/job-nope").status_code == 404

    models = client.get("/v1/megatron/list_models").json()["models"]
    assert [m["name"] for m in models] == [second, first, settings.base_model_name]  # newest first, as ScalarLM's
    assert all(isinstance(m["start_time"], float) and isinstance(m["train_time"], float) for m in models)
    assert models[2]["start_time"] == 0 and models[0]["train_time"] > 0


def test_resubmitting_the_same_data_and_args_trains_again(client):
    first = post_train(client, sdk_archive(), {"max_steps": 3}).json()["job_status"]["job_id"]
    second = post_train(client, sdk_archive(), {"max_steps": 3}).json()["job_status"]["job_id"]
    assert first != second


def test_v1_train_alias_and_plain_jsonl_upload(client, wait_status):
    jsonl = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    response = post_train(client, jsonl, {"max_steps": 2}, path="/v1/train")
    assert response.status_code == 200, response.text
    assert response.json()["job_config"]["dataset_rows"] == len(ROWS)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"max_steps": 3, "bogus_key": 1}, "unknown train arg 'bogus_key'"),
        ({"max_steps": "many"}, "train arg 'max_steps'"),
        ({"learning_rate": -1}, "train arg 'learning_rate'"),
        ({"lora_config": {"r": 8, "rank": 4}}, "unknown train arg 'lora_config.rank'"),
        ({"cpu_ranks": 3, "tensor_parallel_size": 2}, "tensor_parallel_size 2 must divide"),
        ("{not json", "params is not valid JSON"),
        ({"llm_name": "no-such-model"}, "unknown model 'no-such-model'"),
        # Accepted by ScalarLM's JobConfig, not honoured by this trainer: refused rather than ignored.
        ({"trust_remote_code": True}, "trust_remote_code: true is not supported"),
        ({"distribution_strategy": "fsdp"}, "distribution_strategy 'fsdp' is not supported"),
        ({"distribution_strategy": "ddp", "cpu_ranks": 2, "tensor_parallel_size": 2}, "'ddp' is data parallel only"),
        ({"dtype": "float16"}, "dtype 'float16' is not supported for training"),
        ({"dtype": "bfloat16", "gpus": 0}, "dtype 'bfloat16' needs GPUs"),
    ],
)
def test_bad_train_args_are_400_naming_the_problem(client, settings, params, named):
    response = post_train(client, sdk_archive(), params)
    assert response.status_code == 400, response.text
    assert named in error_of(response)["message"]
    assert job_dirs(settings) == []  # nothing is left behind


def test_bad_dataset_row_is_400_naming_the_line(client, settings):
    rows = ROWS[:2] + [{"input": "no output here"}] + ROWS[2:]
    response = post_train(client, sdk_archive(rows), {"max_steps": 3})
    assert response.status_code == 400
    assert "dataset line 3" in error_of(response)["message"]
    assert "output" in error_of(response)["message"]
    assert job_dirs(settings) == []


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "", size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, linkname, size
    return info


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (_member("../evil", size=4), "unsafe path"),
        (_member("ml/../../evil", size=4), "unsafe path"),
        (_member("/tmp/evil", size=4), "unsafe path"),
        (_member("ml/passwd", tarfile.SYMTYPE, "/etc/passwd"), "is a link"),
        (_member("ml/hard", tarfile.LNKTYPE, "dataset.jsonlines"), "is a link"),
        (_member("ml/null", tarfile.CHRTYPE), "device or special file"),
        (_member("ml/fifo", tarfile.FIFOTYPE), "device or special file"),
    ],
)
def test_unsafe_archives_are_400(client, settings, tmp_path, member, why):
    response = post_train(client, sdk_archive(extra=[member]), {"max_steps": 3})
    assert response.status_code == 400, response.text
    assert why in error_of(response)["message"]
    assert job_dirs(settings) == []
    assert not (settings.home / "evil").exists() and not (settings.jobs_dir.parent.parent / "evil").exists()


def test_archive_without_dataset_is_400(client):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("train.txt")
        tar.addfile(info, io.BytesIO(b""))
    response = post_train(client, buf.getvalue(), {"max_steps": 3})
    assert response.status_code == 400 and "no dataset.jsonlines" in error_of(response)["message"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/v1/megatron/train/job-nope"),
        ("get", "/v1/megatron/train/job-nope/metrics"),
        ("get", "/v1/megatron/train/job-nope/logs"),
        ("post", "/v1/megatron/cancel/job-nope"),
        ("post", "/v1/megatron/delete/job-nope"),
        ("get", "/v1/megatron/train/..%2F..%2Fetc"),
    ],
)
def test_unknown_job_is_404(client, method, path):
    response = getattr(client, method)(path)
    assert response.status_code == 404, response.text
    assert error_of(response)["type"] == "not_found_error"


def test_cancel_then_delete_a_running_job(client, settings, wait_status):
    job_id = post_train(client, sdk_archive(), {"max_steps": 1_000_000}).json()["job_status"]["job_id"]
    assert wait_status(client, job_id, ("RUNNING",))["job_status"]["status"] == "RUNNING"

    header, row = client.get("/v1/megatron/squeue").json()["squeue_output"].splitlines()  # ScalarLM's CLI prints it
    assert header.split()[:2] == ["JOBID", "STATUS"] and row.split()[:3] == [job_id, "RUNNING", "local"]

    cancelled = client.post(f"/v1/megatron/cancel/{job_id}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "CANCELLED"
    assert client.get(f"/v1/megatron/train/{job_id}").json()["job_status"]["status"] == "CANCELLED"
    assert client.post(f"/v1/megatron/cancel/{job_id}").json()["status"] == "CANCELLED"  # idempotent

    assert client.post(f"/v1/megatron/delete/{job_id}").json() == {"job_id": job_id, "deleted": True}
    assert client.get(f"/v1/megatron/train/{job_id}").status_code == 404
    assert job_id not in [m["name"] for m in client.get("/v1/megatron/list_models").json()["models"]]


def test_restarted_control_plane_fails_a_job_whose_trainer_died(settings):
    """A job left RUNNING by a dead trainer is FAILED, with the reason, as soon as the app starts again."""
    job = JobDir.under(settings.jobs_dir, "job-orphan")
    job.create()
    job.write_config(TrainJobConfig(job_id=job.job_id, base_model=settings.model, train_args=TrainArgs()))
    job.write_status(JobStatus(job_id=job.job_id, status="RUNNING", step=7))
    dead = subprocess.Popen([sys.executable, "-c", "print('CUDA error: device lost', flush=True)"],
                            stdout=open(job.logs_dir / "launcher.log", "wb"))  # fmt: skip
    dead.wait()
    write_record(job, LaunchRecord(launcher="local", launcher_id=str(dead.pid), pid=dead.pid, start_ticks=1))

    with TestClient(create_app(settings)) as client:  # a control plane starting on the same home
        body = client.get("/v1/megatron/train/job-orphan").json()
    status = body["job_status"]
    assert status["status"] == "FAILED"
    assert status["reason"].startswith(f"trainer process {dead.pid} exited without a final status; last step 7")
    assert "CUDA error: device lost" in status["reason"]


def test_gpu_and_node_counts(client):
    assert client.get("/v1/megatron/gpu_count").json() == {"gpu_count": 0}
    assert client.get("/v1/megatron/node_count").json() == {"node_count": 1}


@pytest.mark.parametrize(("timeout", "cap", "limit"), [(100, 86400, 100.0), (100, 30, 30.0)])
def test_time_limit_is_the_job_timeout_capped_by_max_train_seconds(settings, tmp_path, timeout, cap, limit):
    capped = settings.model_copy(update={"training": settings.training.model_copy(update={"max_train_seconds": cap})})
    trainer = tmp_path / "stand_in_trainer.py"
    trainer.write_text(textwrap.dedent(STAND_IN_TRAINER))
    app = create_app(capped)
    app.state.training = TrainingJobs(capped, {"local": LocalLauncher(capped, entry=[str(trainer)])})
    with TestClient(app) as client:
        response = post_train(client, sdk_archive(), {"max_steps": 1, "timeout": timeout})
        assert response.status_code == 200, response.text
        config = JobDir(capped.jobs_dir / response.json()["job_status"]["job_id"]).read_config()
    assert (config.max_train_seconds, config.time_limit) == (limit, limit)


@pytest.mark.parametrize(
    ("cluster", "sent", "resources"),
    [
        ({"cpu_ranks": 2}, {}, (0, 2)),  # training.cpu_ranks is the default of a CPU job
        ({"cpu_ranks": 2}, {"cpu_ranks": 1}, (0, 1)),  # what a job sends wins
        ({"gpus_per_node": 8}, {}, (1, 1)),  # a GPU cluster: one GPU per job, as ScalarLM
        ({"gpus_per_node": 8}, {"tensor_parallel_size": 2}, (2, 1)),  # ... one per tensor-parallel rank
        ({"gpus_per_node": 8}, {"gpus": 0}, (0, 1)),  # CPU ranks asked for explicitly
    ],
)
def test_resources_a_job_leaves_out_come_from_the_training_settings(settings, tmp_path, cluster, sent, resources):
    from scalarlm.server.jobs import parse_train_args

    training = settings.training.model_copy(update=cluster)
    args = parse_train_args({"max_steps": 1, **sent}, training)
    assert (args.gpus, args.cpu_ranks) == resources


@pytest.mark.parametrize(("role", "gpus", "share"), [("embedded", 1, 0.55), ("embedded", 0, None), ("api", 1, None)])
def test_an_embedded_nodes_gpu_job_gets_the_trainers_share_of_each_gpu(settings, tmp_path, role, gpus, share):
    """config.gpu_memory_split's trainer share reaches the job (its ranks cap their allocations to it)."""
    node = settings.model_copy(update={"server": settings.server.model_copy(update={"role": role})})
    trainer = tmp_path / "stand_in_trainer.py"
    trainer.write_text(textwrap.dedent(STAND_IN_TRAINER))
    jobs = TrainingJobs(node, {"local": LocalLauncher(node, entry=[str(trainer)])})
    config = TrainJobConfig(job_id="job-share", base_model=str(settings.model), train_args=TrainArgs(gpus=gpus))
    job = JobDir.under(node.jobs_dir, "job-share")
    job.create()
    jobs.launch(job, config)
    assert job.read_config().gpu_memory_fraction == share
