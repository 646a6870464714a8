"""Tinker's primitives on a session trainer under DP: two ranks (mpirun, gloo) answer exactly as one rank does.

The same requests go to a one-rank and a two-rank session trainer (written as the control plane writes them):
forward_backward with cross_entropy on three datums (an uneven split: rank 1 runs two, rank 0 one), then with
importance_sampling on the same datums, optim_step, and a forward after it. The losses, the per-token logprobs (in
request order), the grad norm and the logprobs after the step agree, so the two ranks together computed the one
rank's gradient (not twice it) and took the same step. A datum with a bad token id is refused by both ranks alike
(no rank waits on the other) and the trainer goes on.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from trainer_jobs import start_trainer, trainer_output, wait_for

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.session import SessionDir
from scalarlm.protocol.training import TrainArgs, TrainJobConfig

pytestmark = pytest.mark.slow

TOKENS = [[5, 17, 23, 42, 7, 99, 3, 11], [8, 8, 30, 31, 32], [60, 61, 62, 63, 64, 65, 66]]


def _data(rl: bool) -> list[dict[str, Any]]:
    out = []
    for i, tokens in enumerate(TOKENS):
        n = len(tokens) - 1
        inputs: dict[str, Any] = {"target_tokens": tokens[1:]}
        if rl:
            inputs.update(logprobs=[-2.0 - 0.1 * j for j in range(n)], advantages=[(-1.0) ** i * 0.5] * n)
        else:
            inputs["weights"] = [0.0] + [1.0] * (n - 1)
        out.append({"tokens": tokens[:-1], "loss_fn_inputs": inputs})
    return out


REQUESTS = [
    {"op": "forward_backward", "loss_fn": "cross_entropy", "data": _data(False)},
    {"op": "forward_backward", "loss_fn": "importance_sampling", "data": _data(True)},
    {"op": "forward_backward", "loss_fn": "cross_entropy",  # datum 2 is bad: refused before any rank computes
     "data": [*_data(False)[:2], {"tokens": [1, 10**7], "loss_fn_inputs": {"target_tokens": [2, 3]}}]},
    {"op": "optim_step", "adam_params": {"learning_rate": 1e-2}},
    {"op": "forward", "loss_fn": "cross_entropy", "data": _data(False)},
]


def _answers(root: Path, model: Path, ranks: int) -> list[Any]:
    job = JobDir(root / f"tinker-dp{ranks}")
    job.create()
    args = TrainArgs(adapter_type="full", max_steps=1000, cpu_ranks=ranks, lr_schedule="constant")
    job.write_config(TrainJobConfig(job_id=job.job_id, base_model=str(model), train_args=args, session=True))
    job.dataset_path.write_text("")
    files = SessionDir(job)
    files.create()
    proc = start_trainer(job, ranks)
    try:
        results = []
        for k, request in enumerate(REQUESTS, start=1):
            files.write_request(k, [request])
            wait_for(lambda: files.result_path(k).exists() or proc.poll() is not None, 300, f"result {k}")
            assert files.result_path(k).exists(), trainer_output(job)
            results.append(files.read_result(k))
        files.request_end()
        assert proc.wait(timeout=120) == 0, trainer_output(job)
        return results
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[int, list[Any]]:
    root = tmp_path_factory.mktemp("tinker-dp")
    return {ranks: _answers(root, tiny_model_dir, ranks) for ranks in (1, 2)}


def test_two_ranks_answer_as_one_rank_does(answers: dict[int, list[Any]]) -> None:
    one, two = answers[1], answers[2]
    for k in (0, 1, 4):  # forward_backward x 2, forward after the step
        assert one[k].error is None and two[k].error is None, (one[k].error, two[k].error)
        assert two[k].metrics["loss"] == pytest.approx(one[k].metrics["loss"], rel=1e-5, abs=1e-5)
        for a, b in zip(one[k].metrics["outputs"], two[k].metrics["outputs"], strict=True):
            assert len(a["logprobs"]) == len(b["logprobs"])
            assert b["logprobs"] == pytest.approx(a["logprobs"], abs=1e-5)
    step = 3
    assert one[step].error is None and two[step].error is None
    assert two[step].metrics["metrics"]["grad_norm"] == pytest.approx(one[step].metrics["metrics"]["grad_norm"],
                                                                      rel=1e-4)  # fmt: skip
    assert two[step].metrics["metrics"]["datums"] == one[step].metrics["metrics"]["datums"] == 6
    # the step moved the weights, the same way on both layouts
    before, after = one[0].metrics["outputs"][0]["logprobs"], one[4].metrics["outputs"][0]["logprobs"]
    assert max(abs(x - y) for x, y in zip(before, after)) > 1e-3


def test_a_bad_datum_is_refused_on_every_rank_and_the_trainer_goes_on(answers: dict[int, list[Any]]) -> None:
    for ranks in (1, 2):
        bad = answers[ranks][2]
        assert bad.error and "datum 2" in bad.error and "vocabulary" in bad.error, bad.error
        after = answers[ranks][3:]  # the trainer took the next step and answered the forward after it
        assert [r.error for r in after] == [None, None] and after[0].step == 1
