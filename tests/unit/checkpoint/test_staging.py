"""Staged full-weight publish: served from memory at once, landed durably later, pruned once superseded; a kill
during the landing leaves the previous durable step and no torn one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from scalarlm.checkpoint import JobDir, latest_step, list_steps, publish_step
from scalarlm.checkpoint.staging import (
    LANDING_NICE,
    STAGED_GRACE_SECONDS,
    SUPERSEDABLE_FILE,
    StagedPublisher,
    land_orphaned,
    land_staged,
    prune_staged,
    remove_deleted_staging,
    remove_empty_staging,
    servable_step,
    stage_step,
    staging_root,
)
from scalarlm.protocol.training import CheckpointManifest


def manifest(step: int) -> CheckpointManifest:
    return CheckpointManifest(job_id="j", step=step, base_model="b", kind="full", loss=1.0)


def weights(content: bytes):
    def write(d: Path) -> None:
        (d / "model.safetensors").write_bytes(content)
        (d / "config.json").write_text("{}")

    return write


@pytest.fixture
def job(tmp_path: Path) -> JobDir:
    job = JobDir.under(tmp_path / "jobs", "j")
    job.create()
    return job


def test_staging_root_is_per_home_and_off_when_asked_or_missing(tmp_path: Path) -> None:
    assert staging_root("", tmp_path) is None
    assert staging_root(str(tmp_path / "absent"), tmp_path) is None
    a, b = staging_root(str(tmp_path), tmp_path / "home-a"), staging_root(str(tmp_path), tmp_path / "home-b")
    assert a is not None and b is not None and a != b and a.parent == b.parent == tmp_path


def test_a_staged_step_is_served_until_its_durable_copy_lands(job: JobDir, tmp_path: Path) -> None:
    root = tmp_path / "shm"
    publish_step(job, manifest(1), weights(b"one"))
    staged = stage_step(job, root, manifest(2), weights(b"two"))
    assert servable_step(job) == (2, staged)  # newer than the durable latest (1)
    assert latest_step(job) == 1 and list_steps(job) == [1]  # nothing durable yet
    landed = land_staged(job, staged, manifest(2))
    assert servable_step(job) == (2, job.step_dir(2)) and landed == job.step_dir(2)
    assert (landed / "model.safetensors").read_bytes() == b"two" and (landed / "manifest.json").exists()


def test_a_staged_copy_is_pruned_once_landed_and_superseded_or_after_the_grace(job: JobDir, tmp_path: Path) -> None:
    root = tmp_path / "shm"
    one = stage_step(job, root, manifest(1), weights(b"one"))
    assert prune_staged(job, root) == []  # not landed: it is all there is
    land_staged(job, one, manifest(1))
    assert prune_staged(job, root) == [] and one.exists()  # landed, but the newest: a worker may be reading it
    two = stage_step(job, root, manifest(2), weights(b"two"))
    assert prune_staged(job, root) == [1] and not one.exists()  # superseded and landed
    assert prune_staged(job, root) == [] and two.exists()  # step 2 has not landed
    land_staged(job, two, manifest(2))
    assert prune_staged(job, root) == []
    assert prune_staged(job, root, now=time.time() + STAGED_GRACE_SECONDS + 1) == [2] and not two.exists()
    assert servable_step(job) == (2, job.step_dir(2))  # the pointer names a removed copy: the durable one serves
    remove_empty_staging(root)
    assert not root.exists()


def test_the_staged_copies_of_deleted_jobs_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    assert remove_deleted_staging(root, set()) == []  # no staging root yet
    jobs = {name: JobDir.under(tmp_path / "jobs", name) for name in ("kept", "gone", "landing")}
    copies = {name: stage_step(job, root, manifest(1), weights(name.encode())) for name, job in jobs.items()}
    (root / "landing" / "step-2.tmp").mkdir()  # a trainer writing its next step
    assert remove_deleted_staging(root, {"kept", "landing", "a-file"}) == ["gone"]
    assert not (root / "gone").exists()
    assert copies["kept"].exists() and copies["landing"].exists() and (root / "landing" / "step-2.tmp").exists()


def test_a_step_does_not_wait_for_the_previous_landing(job: JobDir, tmp_path: Path, held: Any) -> None:
    publisher = StagedPublisher(job, tmp_path / "shm", held)
    staged = publisher.publish(job, manifest(1), weights(b"one"))
    assert servable_step(job) == (1, staged) and staged.exists()
    held.wait_for_first()
    publisher.publish(job, manifest(2), weights(b"two"))
    publisher.publish(job, manifest(3), weights(b"three"))
    assert not held.release.is_set() and held.landed == [1]  # 2 and 3 were staged while the landing thread was busy
    assert servable_step(job) == (3, tmp_path / "shm" / "j" / "step-3") and latest_step(job) == 1
    held.release.set()
    publisher.wait()
    assert held.landed == [1, 2, 3] and list_steps(job) == [1, 2, 3] and latest_step(job) == 3
    assert (job.checkpoints_dir / "latest").read_text().strip() == "step-3"


def test_a_supersedable_step_overtaken_before_its_landing_began_is_served_but_never_lands(
    job: JobDir, tmp_path: Path, held: Any
) -> None:
    """The landing queue keeps at most the newest supersedable step: a disk slower than the steps no longer builds
    a queue (and staged copies) that grows by a step per step. A step not marked supersedable always lands."""
    root = tmp_path / "shm"
    publisher = StagedPublisher(job, root, held)
    publisher.publish(job, manifest(1), weights(b"one"), supersedable=True)  # lands at once: the thread was idle
    held.wait_for_first()
    for step, supersedable in ((2, True), (3, True), (4, False), (5, True), (6, True)):
        publisher.publish(job, manifest(step), weights(f"w{step}".encode()), supersedable=supersedable)
        assert servable_step(job) == (step, root / "j" / f"step-{step}")  # each step serves once staged
    held.release.set()
    publisher.wait()
    assert held.landed == [1, 4, 6] and list_steps(job) == [1, 4, 6] and latest_step(job) == 6
    assert (job.step_dir(6) / "model.safetensors").read_bytes() == b"w6"
    assert servable_step(job) == (6, job.step_dir(6))
    assert prune_staged(job, root) == [1, 2, 3, 4, 5]  # the left-out copies go with the landed ones
    assert [p.name for p in (root / "j").iterdir()] == ["step-6"]


def test_the_landing_runs_at_the_lowest_cpu_priority_and_the_trainer_keeps_its_own(job: JobDir, tmp_path: Path) -> None:
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    trainer = nice()
    seen: list[tuple[int, int]] = []
    publisher = StagedPublisher(job, tmp_path / "shm", lambda step: seen.append((step, nice())))  # landing thread
    publisher.publish(job, manifest(1), weights(b"one"))
    publisher.wait()
    assert seen == [(1, max(trainer, LANDING_NICE))] and LANDING_NICE == 19
    assert nice() == trainer and list_steps(job) == [1]


def test_a_failed_landing_stops_the_queue_and_is_reported(job: JobDir, tmp_path: Path, held: Any) -> None:
    publisher = StagedPublisher(job, tmp_path / "shm", held)
    publisher.publish(job, manifest(1), weights(b"one"))
    held.wait_for_first()
    job.step_dir(2).write_text("not a directory")  # step 2's landing cannot replace it
    publisher.publish(job, manifest(2), weights(b"two"))
    publisher.publish(job, manifest(3), weights(b"three"))
    held.release.set()
    with pytest.raises(RuntimeError, match="durable copy"):
        publisher.wait()
    assert held.landed == [1] and list_steps(job) == [1] and latest_step(job) == 1  # `latest` never skips step 2
    assert servable_step(job)[0] == 3  # what was staged still serves
    publisher.wait()  # the error was reported once
    job.step_dir(2).unlink()
    assert land_orphaned(job) == [2, 3]  # the reconcile after the failed job lands both, in order
    assert list_steps(job) == [1, 2, 3] and (job.step_dir(3) / "model.safetensors").read_bytes() == b"three"


def test_orphaned_staged_steps_land_in_order_after_a_crash(job: JobDir, tmp_path: Path) -> None:
    root = tmp_path / "shm"
    assert land_orphaned(job) == []  # nothing staged
    publish_step(job, manifest(1), weights(b"one"))
    one = stage_step(job, root, manifest(1), weights(b"one"))
    assert land_orphaned(job) == [] and one.exists()  # already durable
    for step in (2, 3):
        stage_step(job, root, manifest(step), weights(f"w{step}".encode()))
    (root / "j" / "step-4.tmp").mkdir()  # a step the trainer was writing when it died: never served, not landed
    assert land_orphaned(job) == [2, 3]
    assert list_steps(job) == [1, 2, 3] and (job.step_dir(2) / "model.safetensors").read_bytes() == b"w2"
    assert land_orphaned(job) == []


def test_orphaned_steps_land_as_the_trainers_queue_would_have(job: JobDir, tmp_path: Path) -> None:
    """The reconcile after a dead trainer leaves out the supersedable steps a newer staged step overtook, as the
    live queue does (the previous test's steps), and lands the rest: the steps it must keep and the newest."""
    root = tmp_path / "shm"
    publish_step(job, manifest(1), weights(b"one"))
    for step, supersedable in ((2, True), (3, True), (4, False), (5, True), (6, True)):
        stage_step(job, root, manifest(step), weights(f"w{step}".encode()), supersedable)
    assert land_orphaned(job) == [4, 6] and list_steps(job) == [1, 4, 6] and latest_step(job) == 6
    assert not (job.step_dir(6) / SUPERSEDABLE_FILE).exists() and (root / "j" / "step-6" / SUPERSEDABLE_FILE).exists()
    assert prune_staged(job, root) == [2, 3, 4, 5]


LAND = """
import sys
from pathlib import Path
from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.staging import land_staged
from scalarlm.protocol.training import CheckpointManifest
job = JobDir(Path(sys.argv[1]))
land_staged(job, Path(sys.argv[2]), CheckpointManifest(job_id="j", step=2, base_model="b", kind="full"))
"""


def test_a_kill_during_the_landing_leaves_the_previous_step_and_no_torn_one(job: JobDir, tmp_path: Path) -> None:
    publish_step(job, manifest(1), weights(b"one"))
    big = os.urandom(1 << 20) * 384  # 384 MiB: the copy and its fsync take a while
    staged = stage_step(job, tmp_path / "shm", manifest(2), weights(big))
    lander = subprocess.Popen([sys.executable, "-c", LAND, str(job.root), str(staged)])
    tmp = job.checkpoints_dir / "step-2.tmp"
    deadline = time.monotonic() + 60
    while not tmp.exists() and lander.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    lander.send_signal(signal.SIGKILL)
    lander.wait()
    if lander.returncode == 0:
        pytest.fail("the landing finished before the kill: make the staged file bigger")
    assert latest_step(job) == 1 and list_steps(job) == [1]  # `latest` and the complete steps are as before
    assert not job.step_dir(2).exists()
    assert (job.step_dir(1) / "model.safetensors").read_bytes() == b"one"
    assert servable_step(job) == (2, staged)  # the complete staged copy still serves (a rebooted host: step 1)
    land_staged(job, staged, manifest(2))  # the next landing replaces the leftover temp dir
    assert latest_step(job) == 2 and not tmp.exists()


def test_without_room_to_stage_a_step_is_published_durably_at_once(job: JobDir, tmp_path: Path) -> None:
    import shutil

    free = shutil.disk_usage(tmp_path).free
    publisher = StagedPublisher(job, tmp_path / "shm", lambda step: None, expected_bytes=free)  # two copies won't fit
    path = publisher.publish(job, manifest(1), weights(b"one"))
    assert path == job.step_dir(1) and latest_step(job) == 1 and not (tmp_path / "shm").exists()
    assert servable_step(job) == (1, job.step_dir(1))
    publisher.wait()  # nothing pending


def test_landings_keep_the_newest_max_checkpoints_to_keep_steps(job: JobDir, tmp_path: Path) -> None:
    """A staged publisher with `keep` prunes the durable steps after each landing, and so does the landing of a dead
    trainer's staged steps (reading the job's train args)."""
    from scalarlm.protocol.training import TrainArgs, TrainJobConfig

    publisher = StagedPublisher(job, tmp_path / "shm", lambda step: None, keep=2)
    for step in (1, 2, 3, 4):
        publisher.publish(job, manifest(step), weights(b"%d" % step))
        publisher.wait()
    assert list_steps(job) == [3, 4] and latest_step(job) == 4
    job.write_config(TrainJobConfig(job_id="j", base_model="b", train_args=TrainArgs(max_checkpoints_to_keep=1)))
    stage_step(job, tmp_path / "shm", manifest(5), weights(b"5"))
    assert land_orphaned(job) == [5] and list_steps(job) == [5]
