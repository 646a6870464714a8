"""An RL session whose client goes quiet ends itself after `training.session_idle_seconds`: the real trainer saves
its state and exits, the session reads CANCELLED with the idle reason in the trainer's log, its last published
weights stay servable, and a late step is refused (409) instead of waiting on a trainer that is gone."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARGS = {"loss": "grpo", "learning_rate": 1e-3, "max_seq_len": 64, "dtype": "float32"}
ROWS = [
    {"prompt": "2+2=", "completion": "4", "reward": 1.0},
    {"prompt": "2+2=", "completion": "5", "reward": 0.0},
]
IDLE_SECONDS = 3


async def test_idle_session_ends_itself_with_state_saved(control_plane) -> None:
    sections = {"training": {"session_idle_seconds": IDLE_SECONDS, "poll_seconds": 0.5}}
    async with control_plane(**sections) as (client, settings):
        created = await client.post("/v1/train/sessions", json={"train_args": ARGS})
        assert created.status_code == 200, created.text
        sid = created.json()["session_id"]
        step = await client.post(f"/v1/train/sessions/{sid}/step", json={"rows": ROWS, "wait_seconds": 300})
        assert step.status_code == 200, (step.text, (await client.get(f"/v1/megatron/train/{sid}/logs")).text[-3000:])
        assert step.json()["version"] == 1

        deadline = time.monotonic() + 180
        while (session := (await client.get(f"/v1/train/sessions/{sid}")).json())["status"] == "RUNNING":
            assert time.monotonic() < deadline, (await client.get(f"/v1/megatron/train/{sid}/logs")).text[-3000:]
            await asyncio.sleep(0.5)

        assert session["status"] == "CANCELLED" and session["version"] == 1, session
        assert session["reason"].startswith(f"session idle for {IDLE_SECONDS} s"), session
        logs = (await client.get(f"/v1/megatron/train/{sid}/logs")).text
        assert f"session idle for {IDLE_SECONDS} s without a step request" in logs and "state saved at step 1" in logs
        assert any((settings.jobs_dir / sid / "state").iterdir())  # what a resume continues from

        late = await client.post(f"/v1/train/sessions/{sid}/step", json={"rows": ROWS})
        assert late.status_code == 409 and "ended (CANCELLED" in late.json()["error"]["message"], late.text
        queued = await client.post("/v1/generate", json={"prompts": ["2+2="], "model": sid})
        assert queued.status_code == 200  # the last published step stays servable
