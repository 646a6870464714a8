"""`training.max_running_jobs` and a GPU node's GPUs bound the local trainers running at once: later jobs wait QUEUED,
start in submission order as slots free up (also under a new launcher, as after a restart), and cancel while
waiting without ever starting. Real subprocesses (the stand-in trainers of conftest.py)."""

from __future__ import annotations

from scalarlm.config import Settings
from scalarlm.launcher import LocalLauncher, read_record, reconcile


def limited(settings: Settings, **training) -> Settings:
    return settings.model_copy(update={"training": settings.training.model_copy(update=training)})


def test_jobs_past_the_limit_wait_and_start_in_order(settings, program, new_job, wait_for):
    settings = limited(settings, max_running_jobs=1)
    launcher = LocalLauncher(settings, entry=program("obedient"))
    (a, ca), (b, cb), (c, cc) = new_job(), new_job(), new_job()
    assert launcher.submit(a, ca).isdigit()
    assert launcher.submit(b, cb) == "waiting" and launcher.submit(c, cc) == "waiting"
    assert wait_for(lambda: a.read_status().status == "RUNNING")
    status = b.read_status()
    assert status.status == "QUEUED"
    assert status.reason == "waiting for a free trainer slot: 1 of training.max_running_jobs=1 trainers run"
    assert c.read_status().reason == "waiting for a free trainer slot: 1 jobs submitted before it wait first"
    assert launcher.state(b) == ("waiting", "waiting for a free trainer slot")
    assert reconcile(settings.jobs_dir, {"local": launcher}) == []  # waiting is not lost: nothing settled
    assert launcher.admit() == []  # a is still running

    launcher.cancel(a)
    assert a.read_status().status == "CANCELLED"
    assert launcher.admit() == [b.job_id]
    assert wait_for(lambda: b.read_status().status == "RUNNING")
    assert b.read_status().reason is None and read_record(b).pid is not None
    assert c.read_status().status == "QUEUED" and read_record(c).pid is None

    # A new launcher (a restarted control plane) finds the waiting job on disk and starts it when b ends.
    again = LocalLauncher(settings, entry=program("obedient"))
    assert again.admit() == []
    launcher.cancel(b)
    assert again.admit() == [c.job_id]
    assert wait_for(lambda: c.read_status().status == "RUNNING")
    again.cancel(c)


def test_a_waiting_job_cancels_without_starting(settings, program, new_job, wait_for):
    settings = limited(settings, max_running_jobs=1)
    launcher = LocalLauncher(settings, entry=program("obedient"))
    (a, ca), (b, cb) = new_job(), new_job()
    launcher.submit(a, ca)
    launcher.submit(b, cb)
    launcher.cancel(b)
    assert b.read_status().status == "CANCELLED" and read_record(b).pid is None
    launcher.cancel(a)
    assert launcher.admit() == []  # nothing left waiting
    assert read_record(b).pid is None and not b.logs_dir.joinpath("launcher.log").exists()


def test_gpu_jobs_wait_for_the_gpus_they_ask_for(settings, program, new_job, wait_for):
    settings = limited(settings, gpus_per_node=2)
    launcher = LocalLauncher(settings, entry=program("obedient"))
    (a, ca), (b, cb), (c, cc) = new_job(gpus=1), new_job(gpus=2), new_job(gpus=1)
    assert launcher.submit(a, ca).isdigit()
    assert launcher.submit(b, cb) == "waiting"
    assert b.read_status().reason == "waiting for a free trainer slot: it needs 2 GPUs and 1 of this node's 2 are taken"
    # c would fit beside a, but b was first: a large job is not starved by small ones behind it.
    assert launcher.submit(c, cc) == "waiting"
    launcher.cancel(a)
    assert launcher.admit() == [b.job_id]
    assert launcher.admit() == []  # b holds both GPUs
    launcher.cancel(b)
    assert launcher.admit() == [c.job_id]
    launcher.cancel(c)


def test_no_limit_starts_every_job_at_once(settings, program, new_job, wait_for):
    launcher = LocalLauncher(settings, entry=program("obedient"))
    jobs = [new_job() for _ in range(3)]
    assert all(launcher.submit(job, config).isdigit() for job, config in jobs)
    assert wait_for(lambda: all(job.read_status().status == "RUNNING" for job, _ in jobs))
    for job, _ in jobs:
        launcher.cancel(job)


def test_the_control_planes_poll_starts_the_next_waiting_job(settings, program, new_job, wait_for):
    from scalarlm.server.jobs import TrainingJobs

    settings = limited(settings, max_running_jobs=1)
    launcher = LocalLauncher(settings, entry=program("complete"))
    jobs = TrainingJobs(settings, {"local": launcher})
    (a, ca), (b, cb) = new_job(), new_job()
    launcher.submit(a, ca)
    launcher.submit(b, cb)
    assert wait_for(lambda: a.read_status().status == "COMPLETED" and launcher.state(a)[0] == "finished")
    jobs.reconcile()  # what `training.poll_seconds` runs
    assert wait_for(lambda: b.read_status().status == "COMPLETED")
    assert b.read_status().reason is None


def _given(job, ranks: int, wait_for) -> list[str]:
    """What each rank of `job` saw in CUDA_VISIBLE_DEVICES."""
    paths = [job.root / f"devices.{r}" for r in range(ranks)]
    assert wait_for(lambda: all(p.exists() for p in paths))
    return [p.read_text() for p in paths]


def test_each_gpu_job_gets_gpus_of_its_own_and_a_cpu_job_none(settings, program, new_job, wait_for, monkeypatch):
    """Two GPU jobs on one node never share a device, and a CPU job (gpus 0) on a GPU node cannot take one."""
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    settings = limited(settings, gpus_per_node=4)
    launcher = LocalLauncher(settings, entry=program("devices"))
    (a, ca), (b, cb), (c, cc) = new_job(gpus=2), new_job(gpus=1), new_job(gpus=0)
    for job, config in ((a, ca), (b, cb), (c, cc)):
        assert launcher.submit(job, config).isdigit()
    assert _given(a, 2, wait_for) == ["0,1", "0,1"] and _given(b, 1, wait_for) == ["2"]
    assert _given(c, 1, wait_for) == [""]
    assert [read_record(j).devices for j in (a, b, c)] == [["0", "1"], ["2"], []]
    launcher.cancel(a)
    # A restarted control plane reads what the running jobs hold from their launch records.
    again = LocalLauncher(settings, entry=program("devices"))
    (d, cd), (e, ce) = new_job(gpus=1), new_job(gpus=2)
    assert again.submit(d, cd).isdigit() and _given(d, 1, wait_for) == ["0"]
    assert again.submit(e, ce).isdigit() and _given(e, 2, wait_for) == ["1,3", "1,3"]  # the free ones
    (f, cf) = new_job(gpus=1)
    assert again.submit(f, cf) == "waiting"  # b holds 2, d 0, e 1 and 3
    again.cancel(b)
    assert again.admit() == [f.job_id] and _given(f, 1, wait_for) == ["2"]
    for job in (c, d, e, f):
        again.cancel(job)


def test_gpus_come_from_the_servers_own_visible_devices(settings, program, new_job, wait_for, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    settings = limited(settings, gpus_per_node=4)
    launcher = LocalLauncher(settings, entry=program("devices"))
    (a, ca), (b, cb) = new_job(gpus=1), new_job(gpus=3)
    assert launcher.submit(a, ca).isdigit() and launcher.submit(b, cb).isdigit()
    assert _given(a, 1, wait_for) == ["4"] and _given(b, 3, wait_for) == ["5,6,7"] * 3
    for job in (a, b):
        launcher.cancel(job)


def test_a_job_the_launcher_now_refuses_fails_its_relaunch_with_the_reason(settings, program, new_job):
    """A job written before the launcher refused its layout (here 2 nodes) ends FAILED saying why when resumed,
    and the sweep that resumed it goes on."""
    from scalarlm.launcher.reconcile import resume_job

    job, _ = new_job(nodes=2)
    status = resume_job(job, LocalLauncher(settings, entry=program("complete")), "crashed")
    assert status.status == "FAILED"
    assert "nodes 2: the local launcher runs a job's ranks on this one node" in status.reason
