"""Faults a cluster lives with cost nothing: API, two workers and a client on four hosts (network namespaces).

Each test pushes a batch (20,000 prompts for the worker kill, 5,000 for the others) through the real CLI-started
roles and does one thing a cluster does on a bad day in the middle of it: SIGKILL a worker (its leases expire to the other one; a restarted worker rejoins),
SIGKILL the API (workers back off and reconnect; the client's result polls resume), or unplug a worker's network
for a few seconds (it recovers without a restart). Every request id gets exactly one answer, in prompt order.

Trainers run where the chart's API pod runs them without SLURM: under the API's local launcher, on the API's host,
writing to the shared volume. A job submitted from the client host is served by the remote workers once it ends; a
trainer lost mid-job (its processes SIGKILLed, as a lost host loses them) is relaunched from its saved state once
(`training.resume: all`, `max_resumes: 1`), and lost again it ends FAILED with the reason.
"""

from __future__ import annotations

import time

import pytest
from cluster_roles import Cluster, kill_tree, result_of, worker_id

from scalarlm.launcher import read_record

pytestmark = pytest.mark.slow

BIG, BATCH, AFTER = 20_000, 5_000, 1_000  # prompts: the worker-kill batch, the other faults' batch, a follow-up
FAULT_AT = 0.3  # of the batch completed


def _batch(cluster: Cluster, count: int) -> tuple[object, int]:
    """Start a `count`-prompt generate on the client host; the queue's completed count before it."""
    before = cluster.completed()
    return cluster.client("generate", cluster.api_url, str(count), background=True), before


def _assert_all_answered_once(result: dict, count: int) -> None:
    assert result == {**result, "count": count, "unique_ids": count, "answered": count, "in_order": True}, result


def test_streaming_goes_through_the_api_to_a_remote_worker(cluster: Cluster) -> None:
    result = cluster.client("stream", cluster.api_url, cluster.model.name)
    assert result["chunks"] > 1 and result["text"] == result["whole"]
    assert result["fingerprints"] == [f"scalarlm-{cluster.model.name}-v0"]


def test_a_worker_killed_mid_batch_loses_nothing_and_a_restarted_one_rejoins(cluster: Cluster) -> None:
    client, before = _batch(cluster, BIG)
    cluster.wait_completed(before + int(FAULT_AT * BIG))
    killed = cluster.kill("w1")
    _assert_all_answered_once(result_of(client), BIG)

    restarted = cluster.start("w1")
    cluster.wait_up("w1")
    since = time.time()
    client, _ = _batch(cluster, AFTER)
    _assert_all_answered_once(result_of(client), AFTER)
    finishers = cluster.finishers(since)
    assert finishers.get(worker_id(restarted.pid), 0) > 0, finishers  # the restarted worker took work again
    assert worker_id(killed) not in finishers


def test_the_api_killed_mid_batch_workers_reconnect_and_the_client_resumes(cluster: Cluster) -> None:
    client, before = _batch(cluster, BATCH)
    cluster.wait_completed(before + int(FAULT_AT * BATCH))
    cluster.kill("api")
    cluster.start("api")
    restarted_at = time.time()
    _assert_all_answered_once(result_of(client), BATCH)
    finishers = cluster.finishers(restarted_at)
    workers = {worker_id(cluster.procs[name].pid) for name in ("w1", "w2")}
    assert workers <= {w for w, n in finishers.items() if n > 0}, finishers  # both pulled from the new API


def test_a_worker_unplugged_for_seconds_recovers_without_a_restart(cluster: Cluster) -> None:
    w2 = cluster.procs["w2"]
    client, before = _batch(cluster, BATCH)
    cluster.wait_completed(before + int(FAULT_AT * BATCH))
    cluster.hosts["w2"].set_link(False)
    time.sleep(6)  # past the 5 s lease: its in-flight items go back to the queue
    cluster.hosts["w2"].set_link(True)
    _assert_all_answered_once(result_of(client), BATCH)
    assert w2.poll() is None  # the same process
    since = time.time()
    client, _ = _batch(cluster, AFTER)
    _assert_all_answered_once(result_of(client), AFTER)
    assert cluster.finishers(since).get(worker_id(w2.pid), 0) > 0


def test_a_job_trained_through_the_api_is_served_by_the_remote_workers(cluster: Cluster) -> None:
    job_id = cluster.client("train", cluster.api_url, "6", "6")["job_id"]
    assert cluster.client("wait-job", cluster.api_url, job_id) == {"status": "COMPLETED", "step": 6}
    streamed = cluster.client("stream", cluster.api_url, job_id)
    assert streamed["chunks"] > 1 and streamed["text"] == streamed["whole"]
    assert streamed["fingerprints"] == [f"scalarlm-{job_id}-v6"]  # a remote worker serves the step-6 weights
    _assert_all_answered_once(cluster.client("generate", cluster.api_url, "200", job_id), 200)


def test_a_trainer_lost_mid_job_resumes_from_its_saved_state_then_fails_with_the_reason(cluster: Cluster) -> None:
    job_id = cluster.client("train", cluster.api_url, "100000", "2")["job_id"]
    job = cluster.job(job_id)
    cluster.wait_job(job_id, lambda s: s.status == "RUNNING" and s.step >= 3)
    first = read_record(job).pid
    kill_tree(first)

    resumed = cluster.wait_job(job_id, lambda s: s.resumes == 1)
    assert "resuming from the state saved at step" in resumed.reason and "SIGKILL" in resumed.reason, resumed
    saved = int(resumed.reason.split("saved at step ")[1].split(":")[0])
    lost_at = int(resumed.reason.split("last step ")[1].split()[0])
    assert 2 <= saved <= lost_at
    went_on = f"resumed from state at step {saved}"
    cluster.wait_job(job_id, lambda s: went_on in job.rank_log(0).read_text() and len(job.read_metrics()) > lost_at + 1)
    assert read_record(job).pid != first
    # The metrics past the saved state (steps the lost trainer ran again) were replaced, not repeated.
    steps = [row["step"] for row in job.read_metrics()]
    assert steps == list(range(1, len(steps) + 1)), steps

    kill_tree(read_record(job).pid)
    final = cluster.client("wait-job", cluster.api_url, job_id)
    assert final["status"] == "FAILED", final
    assert "SIGKILL without a final status; last step" in final["reason"], final
    assert "not resumed again after 1 resumes" in final["reason"], final
