"""The closed loop for real: `scalarlm serve` (vLLM worker, local trainer), driven through the client.

Train on answers the random base model cannot know, then generate with `model_name=<job>`: the trained
answers come back stamped with the published version, while the base model still answers as before.
An RL session's every step returns a version that the very next generate call is served with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import scalarlm
from scalarlm.client.flows import get_json
from scalarlm.config import host_cores
from scalarlm.protocol.generate import GenerateResult

pytestmark = pytest.mark.slow

# Facts a random tiny model cannot produce greedily (the same kind of rows examples/train_demo.py learns).
FACTS = [
    {"input": "What is the capital of France?", "output": " Paris"},
    {"input": "What do bees make?", "output": " honey"},
    {"input": "What colour is the sky?", "output": " blue"},
]
FULL_ARGS = {"max_steps": 40, "learning_rate": 1e-2, "adapter_type": "full", "steps_per_checkpoint": 40,
             "max_seq_len": 64, "dtype": "float32"}  # fmt: skip


def greedy(llm: scalarlm.ScalarLM, model: str | None) -> list[GenerateResult]:
    return llm.generate([f["input"] for f in FACTS], model_name=model, max_tokens=8, temperature=0,
                        return_details=True)  # fmt: skip


def test_trained_job_answers_with_its_version_and_the_base_is_unchanged(loop_server: str) -> None:
    llm = scalarlm.ScalarLM(api_url=loop_server, timeout=300)
    before = greedy(llm, None)
    assert all(r.version == 0 for r in before)
    job = llm.train(FACTS, train_args=FULL_ARGS)
    job.wait(timeout=900)
    step = job.info().checkpoints[-1]

    trained = greedy(llm, job.id)
    assert [r.model for r in trained] == [job.id] * len(FACTS)
    assert [r.version for r in trained] == [step] * len(FACTS)
    right = sum(r.response.strip() == f["output"].strip() for r, f in zip(trained, FACTS))
    assert right >= len(FACTS) - 1, [r.response for r in trained]

    after = greedy(llm, None)
    assert [r.response for r in after] == [r.response for r in before]
    assert all(r.version == 0 for r in after)
    models = {m["id"]: m for m in llm._run(get_json("/v1/models"))["data"]}
    assert models[job.id]["scalarlm_version"] == step


def test_each_session_step_is_served_by_the_next_generate(loop_server_home: tuple[str, Path]) -> None:
    loop_server, home = loop_server_home
    llm = scalarlm.ScalarLM(api_url=loop_server, timeout=300)
    prompt = FACTS[0]["input"]
    # No `loss`: a session trains its scored rows with GRPO by default.
    with llm.rl_session(train_args={"learning_rate": 1e-2, "max_seq_len": 64, "dtype": "float32"}) as session:
        versions = []
        for i in range(3):
            rows = [{"prompt": prompt, "completion": c, "reward": r}
                    for c, r in ((" Paris", 1.0), (" blue", 0.0), (" honey", 0.0), (" Paris", 1.0))]  # fmt: skip
            # The last step is submitted (the client may generate while it trains), the others waited on.
            version = session.step(rows) if i < 2 else session.submit(rows).result().version
            [result] = llm.generate([prompt], model_name=session.model_name, max_tokens=2, temperature=0,
                                    return_details=True)  # fmt: skip
            assert (result.model, result.version) == (session.model_name, version)
            versions.append(version)
        assert versions == sorted(set(versions)) and versions[0] >= 1
    assert session.info().status in ("COMPLETED", "CANCELLED")
    # This node's vLLM engine computes on the trainer's CPU cores. A step the client waits on has them all; one it
    # may generate beside (max_staleness 1, the default) takes half, not one thread on every core beside the engine's.
    metrics = [json.loads(line) for line in (home / "jobs" / session.id / "metrics.jsonl").read_text().splitlines()]
    alone, overlapped = (int(os.environ["OMP_NUM_THREADS"]),) * 2 if "OMP_NUM_THREADS" in os.environ else (
        host_cores(), max(1, host_cores() // 2))  # fmt: skip
    assert [m["cpu_threads"] for m in metrics] == [alone, alone, overlapped]
    assert [m["reward_mean"] for m in metrics] == [0.5, 0.5, 0.5]  # GRPO's metrics: the scores were trained on
    log = (home / "jobs" / session.id / "logs" / "rank-0.log").read_text()
    assert f"rank 0: {alone} CPU threads ({overlapped} while a session step overlaps generation)" in log
