"""RL session routes over a real control plane, real LocalLauncher and a stand-in trainer process.

The stand-in (session_standin.py) follows the session file contract; what is under test is the control
plane: row validation, request/result hand-off, versions reaching workers, `end`, and failing fast when
the trainer dies.
"""

from __future__ import annotations

import sys
from pathlib import Path

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.session import SessionDir
from scalarlm.launcher.local import LocalLauncher
from scalarlm.server.jobs import TrainingJobs
from scalarlm.server.sessions import RLSessions

STANDIN = Path(__file__).with_name("session_standin.py")

RL_ROWS = [
    {"prompt": "3+4=", "completion": "7", "reward": 1.0},
    {"prompt": "3+4=", "completion": "8", "reward": 0.0, "logprobs": [-0.5]},
]


def use_standin(client) -> None:  # type: ignore[no-untyped-def]
    """Swap the app's launcher for one that runs the stand-in trainer (the app object is the transport's)."""
    use_standin_in(client._transport.app)


def use_standin_in(app) -> None:  # type: ignore[no-untyped-def]
    """Swap the launcher of `app` for one that runs the stand-in trainer."""
    settings = app.state.server.settings
    jobs = TrainingJobs(settings, launchers={"local": LocalLauncher(settings, python=sys.executable,
                                                                    entry=[str(STANDIN)], grace_seconds=5)})
    app.state.training = jobs
    app.state.sessions = RLSessions(jobs, app.state.server.catalog)


async def test_session_steps_return_versions_workers_serve(control_plane) -> None:
    async with control_plane(training={"poll_seconds": 0.2}) as (client, settings):
        use_standin(client)
        created = await client.post("/v1/train/sessions", json={"train_args": {"learning_rate": 1e-3}})
        assert created.status_code == 200, created.text
        session = created.json()
        sid = session["session_id"]
        assert session["model_name"] == sid and session["version"] == 0

        for expected in (1, 2):
            reply = await client.post(f"/v1/train/sessions/{sid}/step", json={"rows": RL_ROWS, "wait_seconds": 60})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            assert (body["version"], body["step"], body["metrics"]) == (expected, expected, {"rows": 2})
            work = (await client.post("/v1/generate/get_work", json={"capacity": 0})).json()
            assert {m["name"]: m["version"] for m in work["models"]}[sid] == expected

        sft = await client.post(f"/v1/train/sessions/{sid}/step", json={"rows": [{"input": "a", "output": "b"}]})
        assert sft.status_code == 400 and "this session trains loss 'grpo'" in sft.text, sft.text  # the default
        third = await client.post(f"/v1/train/sessions/{sid}/step", json={"rows": RL_ROWS, "wait_seconds": 60})
        assert third.status_code == 200 and third.json()["version"] == 3
        assert (await client.get(f"/v1/train/sessions/{sid}")).json()["version"] == 3
        # A submitted step may train while the client generates (unless it says not); a step waited on may not.
        for body in ({"rows": RL_ROWS}, {"rows": RL_ROWS, "overlap": False}):
            queued = await client.post(f"/v1/train/sessions/{sid}/steps", json=body)
            assert queued.status_code == 200, queued.text
            await client.get(f"/v1/train/sessions/{sid}/steps/{queued.json()['request']}?wait_seconds=60")
        files = SessionDir(JobDir.under(settings.jobs_dir, sid))
        assert [files.read_meta(k).overlap for k in range(1, 6)] == [False, False, False, True, False]

        ended = await client.delete(f"/v1/train/sessions/{sid}")
        assert ended.status_code == 200 and ended.json()["status"] == "COMPLETED"
        late = await client.post(f"/v1/train/sessions/{sid}/step", json={"rows": RL_ROWS})
        assert late.status_code == 409 and "ended" in late.json()["error"]["message"]
        queued = await client.post("/v1/generate", json={"prompts": ["hi"], "model": sid})
        assert queued.status_code == 200  # the ended session's weights stay servable

        # A session seeded from this one's newest step links that step into its own base/ (this one may prune it).
        seeded = await client.post("/v1/train/sessions", json={"model_name": sid})
        assert seeded.status_code == 200, seeded.text
        child = JobDir.under(settings.jobs_dir, seeded.json()["session_id"])
        origin = JobDir.under(settings.jobs_dir, sid).step_dir(5)
        assert child.read_config().base_model == str(child.base_dir)
        assert sorted(p.name for p in child.base_dir.iterdir()) == sorted(p.name for p in origin.iterdir())
        assert all((child.base_dir / p.name).stat().st_ino == p.stat().st_ino for p in origin.iterdir())
        assert (await client.delete(f"/v1/train/sessions/{child.job_id}")).status_code == 200


async def test_bad_rows_are_400_and_a_dead_trainer_fails_the_step_fast(control_plane) -> None:
    async with control_plane(training={"poll_seconds": 0.2}) as (client, _):
        use_standin(client)
        sid = (await client.post("/v1/train/sessions", json={})).json()["session_id"]
        for rows, words in (
            ([{"prompt": "x", "completion": "y", "reward": "high"}], "reward"),
            ([{"prompt": "x", "completion": "y", "reward": 1, "extra": 1}], "extra"),
            ([{"completion": "y", "reward": 1}], "prompt"),
            ([{"text": "x"}], "expected"),
            ([RL_ROWS[0], {"prompt": "x", "completion": "y"}], "rows[1]: field 'reward' is required"),
            ([RL_ROWS[0], {"prompt": "x", "completion": "y", "reward": 0}],
             "rows: every group holds one completion (2 rows in 2 groups)"),
        ):
            reply = await client.post(f"/v1/train/sessions/{sid}/step", json={"rows": rows})
            assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text
        bad_args = await client.post("/v1/train/sessions", json={"train_args": {"nope": 1}})
        assert bad_args.status_code == 400 and "nope" in bad_args.json()["error"]["message"]
        mu = await client.post("/v1/train/sessions", json={"train_args": {"loss": "grpo", "num_iterations": 2}})
        assert mu.status_code == 400 and "num_iterations > 1 is not supported for RL sessions" in mu.text, mu.text
        reweight = await client.post("/v1/train/sessions", json={"train_args": {"loss": "sft"},
                                                                  "stale_policy": "reweight"})  # fmt: skip
        assert reweight.status_code == 400 and "a loss 'sft' session can only refuse" in reweight.text, reweight.text
        cosine = await client.post("/v1/train/sessions", json={"train_args": {"lr_schedule": "cosine"}})
        assert cosine.status_code == 400 and "send max_steps" in cosine.text, cosine.text
        sft = (await client.post("/v1/train/sessions", json={"train_args": {"loss": "sft"}})).json()["session_id"]
        scores = await client.post(f"/v1/train/sessions/{sft}/step", json={"rows": RL_ROWS})
        assert scores.status_code == 400 and "created with loss 'sft'" in scores.text, scores.text
        rows = await client.post(f"/v1/train/sessions/{sft}/step", json={"rows": [{"input": "a", "output": "b"}],
                                                                            "wait_seconds": 60})  # fmt: skip
        assert rows.status_code == 200 and rows.json()["version"] == 1, rows.text
        await client.delete(f"/v1/train/sessions/{sft}")

        reply = await client.post(f"/v1/train/sessions/{sid}/step",
                                  json={"rows": [{"prompt": "x", "completion": "die", "reward": 1},
                                                 {"prompt": "x", "completion": "y", "reward": 0}], "wait_seconds": 120})
        assert reply.status_code == 503
        assert "FAILED" in reply.json()["error"]["message"]
        assert (await client.get(f"/v1/train/sessions/{sid}")).json()["status"] == "FAILED"

        job = (await client.get("/v1/train/sessions/job-missing")).status_code
        assert job == 404


async def test_a_session_that_names_max_steps_takes_that_many(control_plane) -> None:
    """A decaying schedule needs a horizon: with max_steps (here with cosine) the steps past it are refused (409),
    so no step trains at the schedule's end value; without max_steps a session is open-ended."""
    async with control_plane(training={"poll_seconds": 0.2}) as (client, settings):
        use_standin(client)
        cosine = {"lr_schedule": "cosine", "max_steps": 1}
        created = await client.post("/v1/train/sessions", json={"train_args": cosine})
        assert created.status_code == 200, created.text
        sid = created.json()["session_id"]
        first = await client.post(f"/v1/train/sessions/{sid}/step", json={"rows": RL_ROWS, "wait_seconds": 60})
        assert first.status_code == 200 and first.json()["version"] == 1, first.text
        past = await client.post(f"/v1/train/sessions/{sid}/step", json={"rows": RL_ROWS})
        assert past.status_code == 409 and "has taken its max_steps 1 steps" in past.text, past.text
        await client.delete(f"/v1/train/sessions/{sid}")
        config = JobDir.under(settings.jobs_dir, sid).read_config()
        assert (config.train_args.loss, config.train_args.max_steps) == ("grpo", 1)  # loss: the session default
        open_ended = (await client.post("/v1/train/sessions", json={})).json()["session_id"]
        args = JobDir.under(settings.jobs_dir, open_ended).read_config().train_args
        assert (args.loss, args.lr_schedule, args.max_steps) == ("grpo", "constant", 10_000_000)
        assert args.timeout == settings.training.max_train_seconds  # not a batch job's 4 hours
        assert args.max_checkpoints_to_keep == 3  # it publishes every step; a job keeps every step unless told
        await client.delete(f"/v1/train/sessions/{open_ended}")
