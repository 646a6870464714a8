"""Bounded staleness in a real session trainer (`python -m scalarlm.training <job_dir>`); the test writes the session
files as the control plane would, request k+1 while step k trains.

With `max_staleness` 1: a batch generated on the weights it trains, or one version older, trains; one two versions
older is refused ("stale", naming the versions), or with `stale_policy` "reweight" trained with its clipped
importance ratio against the sampling logprobs: the step's loss equals that objective computed here with NumPy from
`transformers` logprobs of the checkpoint it trained, over every row (the trainer leaves out the rows whose advantage
is 0: a group of equal rewards, a reward equal to its group's mean). Results and `metrics.jsonl` carry the versions.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from trainer_jobs import SessionTrainer, trainer_output, wait_for

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.session import SessionDir
from scalarlm.protocol.training import SessionRequestMeta, SessionStepResult, TrainArgs, TrainJobConfig

ARGS = dict(adapter_type="full", loss="grpo", kl_coef=0.0, learning_rate=1e-3, lr_schedule="constant",
            max_seq_len=64, clip_eps=0.2, dtype="float32")  # fmt: skip
CLIP = 0.2


def _rows(version: int | None = None) -> list[dict]:
    rows = [
        {"prompt": "2+2=", "completion": "4", "reward": 1.0, "logprobs": [-1.0, -0.5]},
        {"prompt": "2+2=", "completion": "5", "reward": 0.0},
        {"prompt": "3+3=", "completion": "6", "reward": 1.0, "group": "g3"},
        {"prompt": "3+3=", "completion": "7", "reward": 0.0, "group": "g3"},
    ]
    return [{**r, "version": version} for r in rows] if version is not None else rows


@contextmanager
def session_trainer(root: Path, model: Path, policy: str) -> Iterator[tuple[JobDir, SessionDir, subprocess.Popen]]:
    job = JobDir(root / f"session-{policy}")
    job.create()
    job.write_config(TrainJobConfig(job_id=job.job_id, base_model=str(model), train_args=TrainArgs(**ARGS),
                                    session=True, session_max_staleness=1, session_stale_policy=policy))  # fmt: skip
    job.dataset_path.write_text("")
    SessionDir(job).create()
    with SessionTrainer(job) as trainer:
        yield job, trainer.files, trainer.proc


def _request(files: SessionDir, k: int, rows: list[dict], version: int | None) -> None:
    files.write_request(k, rows, SessionRequestMeta(version=version, accepted=0.0))


def _result(job: JobDir, files: SessionDir, proc: subprocess.Popen, k: int) -> SessionStepResult:
    wait_for(lambda: files.result_path(k).exists() or proc.poll() is not None, 300, f"result {k}")
    result = files.read_result(k)
    assert result is not None, trainer_output(job)
    return result


def _two_steps_queued_back_to_back(job: JobDir, files: SessionDir, proc: subprocess.Popen) -> None:
    """Request 2 is written while step 1 trains (no result yet); the trainer takes them one at a time, in order."""
    _request(files, 1, _rows(), version=0)
    _request(files, 2, _rows(version=0), version=None)  # the version on the rows this time
    assert not files.result_path(1).exists()
    one, two = _result(job, files, proc, 1), _result(job, files, proc, 2)
    assert (one.error, two.error) == (None, None), (one.error, two.error)
    assert [(r.version, r.generated_version, r.staleness) for r in (one, two)] == [(1, 0, 0), (2, 0, 1)]
    assert one.started <= one.finished <= two.started <= two.finished


def test_refuse_two_versions_old(tmp_path: Path, tiny_model_dir: Path) -> None:
    with session_trainer(tmp_path, tiny_model_dir, "refuse") as (job, files, proc):
        _two_steps_queued_back_to_back(job, files, proc)
        _request(files, 3, _rows(), version=0)
        stale = _result(job, files, proc, 3)
        assert stale.error_type == "stale" and (stale.version, stale.staleness) == (2, 2)
        assert "generated with version 0" in stale.error and "weights at version 2" in stale.error
        assert "max_staleness 1" in stale.error
        _request(files, 4, _rows(), version=1)  # one version old: trains
        fine = _result(job, files, proc, 4)
        assert fine.error is None and (fine.version, fine.staleness) == (3, 1)
    metrics = job.read_metrics()
    assert [(m["step"], m["generated_version"], m["trained_version"], m["staleness"], m["request"])
            for m in metrics] == [(1, 0, 0, 0, 1), (2, 0, 1, 1, 2), (3, 1, 2, 1, 4)]  # fmt: skip


def _completion_logprobs(checkpoint: Path, rows: list[dict]) -> list[np.ndarray]:
    """Per completion token, its logprob under `checkpoint` (transformers, float32), as the trainer sees the row."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for row in rows:
        prompt = tok(row["prompt"], add_special_tokens=True)["input_ids"]
        ids = prompt + row["completion_token_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        out.append(np.array([logp[p - 1, ids[p]].item() for p in range(len(prompt), len(ids))]))
    return out


def _importance_weighted_loss(rows: list[dict], logp: list[np.ndarray]) -> float:
    """GRPO's clipped importance-weighted objective (group-normalised advantages, 1 / (len_i * N) weights)."""
    rewards = np.array([r["reward"] for r in rows])
    groups = [r["group"] for r in rows]
    adv = np.zeros(len(rows))
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std(ddof=1) + 1e-4)
    total = 0.0
    for i, row in enumerate(rows):
        ratio = np.exp(logp[i] - np.array(row["logprobs"]))
        per_token = -np.minimum(ratio * adv[i], np.clip(ratio, 1 - CLIP, 1 + CLIP) * adv[i])
        total += per_token.sum() / (len(logp[i]) * len(rows))
    return float(total)


def test_reweight_trains_a_too_stale_batch_with_its_importance_ratio(tmp_path: Path, tiny_model_dir: Path) -> None:
    with session_trainer(tmp_path, tiny_model_dir, "reweight") as (job, files, proc):
        _two_steps_queued_back_to_back(job, files, proc)
        _request(files, 3, _rows(), version=0)  # two versions old, and not every row has sampling logprobs
        missing = _result(job, files, proc, 3)
        assert missing.error_type == "stale" and "logprobs" in missing.error and "version 2" in missing.error
        _request(files, 4, _rows(), version=7)
        future = _result(job, files, proc, 4)
        assert future.error_type == "invalid" and "version 7" in future.error

        # A fixed batch, two versions old, with sampling logprobs offset from the current ones (some ratios clip).
        rows = [
            {"prompt": "2+2=", "completion_token_ids": [17, 23, 5], "reward": 1.0, "group": "a"},
            {"prompt": "2+2=", "completion_token_ids": [40, 2], "reward": 0.0, "group": "a"},
            {"prompt": "2+2=", "completion_token_ids": [9], "reward": 0.5, "group": "a"},
            {"prompt": "5+1=", "completion_token_ids": [31, 32, 33, 34], "reward": 1.0, "group": "b"},
            {"prompt": "5+1=", "completion_token_ids": [12, 11], "reward": 0.0, "group": "b"},
            # equal rewards, advantage 0: left out of the computation, yet in the loss's normalisation and token count
            {"prompt": "1+1=", "completion_token_ids": [7, 8], "reward": 0.5, "group": "c"},
            {"prompt": "1+1=", "completion_token_ids": [19], "reward": 0.5, "group": "c"},
        ]
        current = _completion_logprobs(job.step_dir(2), rows)
        offsets = iter([0.0, 0.5, -0.5, 0.1, -0.3, 0.25, -0.05, 0.6, -0.6, 0.15, 0.3, -0.2, 0.2, -0.4, 0.05])
        for row, lp in zip(rows, current):
            row.update(completion="", logprobs=[float(x + next(offsets)) for x in lp])
        _request(files, 5, rows, version=0)
        trained = _result(job, files, proc, 5)
        assert trained.error is None, trained.error
        assert (trained.version, trained.generated_version, trained.staleness) == (3, 0, 2)
        assert trained.loss == pytest.approx(_importance_weighted_loss(rows, current), rel=1e-4, abs=1e-6)
        assert trained.metrics["clip_fraction"] > 0 and trained.metrics["logprobs_mismatched_rows"] == 0
        # group c, and group a's 0.5 row (its group's mean): advantage 0, not computed, every token counted
        assert trained.metrics["rows_skipped"] == 3 and trained.metrics["loss_tokens"] == 15
        # the two computed rows of group a, and of group b, each compute their prompt (but its last token) once
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        prompts = [len(tok(p)["input_ids"]) - 1 for p in ("2+2=", "5+1=")]
        assert trained.metrics["prompt_tokens_shared"] == sum(prompts) > 0
    metrics = job.read_metrics()
    assert [(m["step"], m["staleness"], m["reweighted"]) for m in metrics] == [(1, 0, False), (2, 1, False),
                                                                               (3, 2, True)]  # fmt: skip
