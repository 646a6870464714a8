"""The job-directory contract: atomic status and checkpoint publish; readers never see half a step."""

import json

import pytest

from scalarlm.checkpoint import JobDir, latest_step, list_steps, publish_step, read_manifest, repair_latest
from scalarlm.protocol.training import CheckpointManifest, JobStatus


def test_status_and_metrics_round_trip(tmp_path):
    job = JobDir.under(tmp_path, "job-1")
    job.create()
    job.write_status(JobStatus(job_id="job-1", status="RUNNING", max_steps=3))
    job.update_status(step=2, loss=1.5)
    st = job.read_status()
    assert (st.status, st.step, st.loss, st.max_steps) == ("RUNNING", 2, 1.5, 3)
    job.append_metrics({"step": 1, "loss": 2.0})
    with open(job.metrics_path, "a") as f:
        f.write('{"step": 2, "lo')  # a line being written right now
    assert job.read_metrics() == [{"step": 1, "loss": 2.0}]


def test_job_ids_cannot_escape_jobs_dir(tmp_path):
    with pytest.raises(ValueError):
        JobDir.under(tmp_path, "../etc")


def test_publish_is_atomic_and_latest_moves(tmp_path):
    job = JobDir.under(tmp_path, "j")
    job.create()
    assert latest_step(job) is None

    def write(d):
        (d / "model.safetensors").write_bytes(b"w" * 10)
        # while writing, the final name does not exist and latest does not name it
        assert not job.step_dir(5).exists()
        assert latest_step(job) is None

    publish_step(job, CheckpointManifest(job_id="j", step=5, base_model="b", kind="full"), write)
    assert latest_step(job) == 5 and list_steps(job) == [5]
    assert read_manifest(job, 5).kind == "full"
    assert json.loads((job.step_dir(5) / "manifest.json").read_text())["step"] == 5

    def crash(d):
        (d / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        publish_step(job, CheckpointManifest(job_id="j", step=6, base_model="b", kind="full"), crash)
    assert latest_step(job) == 5 and list_steps(job) == [5]  # the half step is invisible


def test_a_crash_between_the_rename_and_the_pointer_leaves_the_renamed_step_latest(tmp_path):
    job = JobDir.under(tmp_path, "j")
    job.create()
    for step in (3, 6):
        publish_step(job, CheckpointManifest(job_id="j", step=step, base_model="b", kind="full"),
                     lambda d: (d / "model.safetensors").write_bytes(b"w"))
    (job.checkpoints_dir / "latest").write_text("step-3\n")  # step-6 renamed into place, the pointer not moved yet
    assert latest_step(job) == 6 and list_steps(job) == [3, 6]
    assert repair_latest(job) == 6 and (job.checkpoints_dir / "latest").read_text() == "step-6\n"
    (job.checkpoints_dir / "latest").unlink()
    assert repair_latest(job) == 6 and (job.checkpoints_dir / "latest").read_text() == "step-6\n"


def test_publish_syncs_every_new_file_and_the_folder_but_not_linked_base_files(tmp_path, monkeypatch):
    """What a power cut could lose is on disk before the rename: each file with new bytes, and the folder's entries
    (the hard links to the base model's tokenizer files carry no new bytes; their entries ride on the folder's sync)."""
    import os

    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text("{}")
    job = JobDir.under(tmp_path, "j")
    job.create()
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    def write(d):
        (d / "adapter_model.safetensors").write_bytes(b"w" * 10)
        os.link(base / "tokenizer.json", d / "tokenizer.json")

    final = publish_step(job, CheckpointManifest(job_id="j", step=1, base_model="b", kind="lora"), write)
    tmp = str(final) + ".tmp"
    assert {f"{tmp}/adapter_model.safetensors", f"{tmp}/manifest.json", tmp, str(job.checkpoints_dir)} <= set(synced)
    assert f"{tmp}/tokenizer.json" not in synced
    assert (final / "tokenizer.json").read_text() == "{}"


def test_max_checkpoints_to_keep_removes_the_older_steps_after_each_publish(tmp_path):
    """ScalarLM's `max_checkpoints_to_keep`: after a step lands, only the newest `keep` complete steps remain."""
    job = JobDir.under(tmp_path, "j")
    job.create()
    for step in (2, 4, 6):
        publish_step(job, CheckpointManifest(job_id="j", step=step, base_model="b", kind="full"),
                     lambda d: (d / "model.safetensors").write_bytes(b"w"))  # fmt: skip
    assert list_steps(job) == [2, 4, 6]  # keep None: every step
    (job.checkpoints_dir / "step-9.tmp").mkdir()  # a step being written is not a step
    publish_step(job, CheckpointManifest(job_id="j", step=8, base_model="b", kind="full"),
                 lambda d: (d / "model.safetensors").write_bytes(b"8"), keep=2)  # fmt: skip
    assert list_steps(job) == [6, 8] and latest_step(job) == 8
    assert sorted(p.name for p in job.checkpoints_dir.iterdir()) == ["latest", "step-6", "step-8", "step-9.tmp"]
    publish_step(job, CheckpointManifest(job_id="j", step=10, base_model="b", kind="lora"),
                 lambda d: (d / "adapter_model.safetensors").write_bytes(b"a"), keep=1)  # fmt: skip
    assert list_steps(job) == [10] and read_manifest(job, 10).kind == "lora"
