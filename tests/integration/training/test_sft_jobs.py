"""Real SFT jobs through `python -m scalarlm.training <job_dir>` (one process and real `mpirun -n 2`).

One reference job (one rank) is shared by the module: it memorises 8 question -> answer pairs, publishes HF
checkpoints, and is the loss curve the DP=2, SIGKILL-resume and SIGTERM-resume jobs must reproduce.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from trainer_jobs import (
    QA,
    child_pids,
    losses,
    make_job,
    qa_rows,
    require_mpirun,
    run_trainer,
    start_trainer,
    trainer_output,
    wait_for,
)

from scalarlm.checkpoint import JobDir, latest_step, read_manifest
from scalarlm.config import Settings
from scalarlm.launcher import LocalLauncher, reconcile_job

LONG_ROW = {"input": "Count: " + " ".join(str(n) for n in range(40)), "output": " and so on"}
TRAIN_ARGS = dict(
    max_steps=60,
    learning_rate=3e-3,
    warmup_steps=2,
    batch_size=4,
    steps_per_checkpoint=10,
    adapter_type="full",
    max_seq_len=32,
    seed=0,
)
# The same global batch (4 blocks) as two ranks x 2 micro-batches of 1 block: DP, the overlapped bucket all-reduce
# and gradient accumulation together.
DP2_ARGS = {**TRAIN_ARGS, "batch_size": 1, "gradient_accumulation_steps": 2, "cpu_ranks": 2}
DP_TOLERANCE = 1e-4  # DP=2 vs one rank on the same global batch (fp32; different reduction order)
RESUME_TOLERANCE = 1e-5  # resumed vs uninterrupted, same layout


def rows() -> list[dict]:
    return qa_rows() + [LONG_ROW]


@pytest.fixture(scope="module")
def jobs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jobs")


@pytest.fixture(scope="module")
def reference(jobs_root: Path, tiny_model_dir: Path) -> JobDir:
    """The uninterrupted one-rank job."""
    job = make_job(jobs_root, "reference", tiny_model_dir, rows(), **TRAIN_ARGS)
    assert run_trainer(job) == 0, trainer_output(job)
    return job


@pytest.fixture(scope="module")
def dp2(jobs_root: Path, tiny_model_dir: Path) -> JobDir:
    """The same global batch (4 blocks) as two ranks of 2 micro-batches of 1 block under mpirun."""
    require_mpirun()
    job = make_job(jobs_root, "dp2", tiny_model_dir, rows(), **DP2_ARGS)
    assert run_trainer(job, ranks=2) == 0, trainer_output(job)
    return job


def _greedy_answer(model, tokenizer, question: str) -> str:
    ids = tokenizer(question + " ", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_sft_memorises_and_publishes_hf_checkpoint(reference: JobDir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    status = reference.read_status()
    assert status.status == "COMPLETED" and status.step == TRAIN_ARGS["max_steps"], status
    assert status.details["data"]["truncated_rows"] == 1  # LONG_ROW is cut to max_seq_len, not a crash

    metrics = reference.read_metrics()
    assert len(metrics) == TRAIN_ARGS["max_steps"]
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_second", "time", "truncated_rows"):
        assert key in metrics[-1]
    assert metrics[0]["loss"] > 3.0 and metrics[-1]["loss"] < 0.1, [m["loss"] for m in metrics]

    assert latest_step(reference) == TRAIN_ARGS["max_steps"]
    for step in (10, 20, 60):
        assert read_manifest(reference, step).kind == "full"
    path = reference.step_dir(TRAIN_ARGS["max_steps"])
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    answers = {q: _greedy_answer(model, tokenizer, q) for q, _ in QA}
    reproduced = [q for q, a in QA if answers[q].strip() == a]
    assert len(reproduced) >= 6, answers


@pytest.mark.slow
def test_dp2_under_mpirun_matches_one_rank(reference: JobDir, dp2: JobDir) -> None:
    assert dp2.read_status().status == "COMPLETED"
    ours, ref = losses(dp2), losses(reference)
    assert len(ours) == len(ref)
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= DP_TOLERANCE, (ours, ref)
    assert (dp2.root / "logs" / "rank-1.log").exists()


@pytest.mark.slow
def test_sigkill_mid_job_then_resume_matches_uninterrupted(reference: JobDir, jobs_root: Path, tiny_model_dir: Path) -> None:
    job = make_job(jobs_root, "killed", tiny_model_dir, rows(), **TRAIN_ARGS)
    proc = start_trainer(job)
    try:
        wait_for(lambda: len(job.read_metrics()) >= 14 or proc.poll() is not None, 300, "14 steps")
        assert proc.poll() is None, "the job finished before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert job.read_status().status == "RUNNING"  # a SIGKILLed trainer cannot say anything (the launcher does)
    saved = json.loads((job.state_dir / "latest.json").read_text())["step"]
    assert 10 <= saved < TRAIN_ARGS["max_steps"]

    assert run_trainer(job) == 0, trainer_output(job)
    assert job.read_status().status == "COMPLETED"
    ours, ref = losses(job), losses(reference)
    assert len(ours) == len(ref)
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= RESUME_TOLERANCE


@pytest.mark.slow
def test_sigterm_under_mpirun_saves_state_and_resume_matches(dp2: JobDir, jobs_root: Path, tiny_model_dir: Path) -> None:
    job = make_job(jobs_root, "terminated", tiny_model_dir, rows(), **DP2_ARGS)
    proc = start_trainer(job, ranks=2)
    try:
        wait_for(lambda: len(job.read_metrics()) >= 5 or proc.poll() is not None, 300, "5 steps")
        assert proc.poll() is None, "the job finished before it could be terminated"
        ranks = child_pids(proc)
        assert len(ranks) == 2
        for pid in ranks:  # as SLURM does; mpirun itself SIGKILLs ranks 1 s after forwarding a SIGTERM
            os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    status = job.read_status()
    assert status.status == "FAILED", trainer_output(job)
    assert "terminated by SIGTERM at step" in status.reason and "state saved, resume the job" in status.reason
    saved = json.loads((job.state_dir / "latest.json").read_text())["step"]
    assert saved == status.step and 5 <= saved < TRAIN_ARGS["max_steps"]

    assert run_trainer(job, ranks=2) == 0, trainer_output(job)
    assert job.read_status().status == "COMPLETED"
    ours, ref = losses(job), losses(dp2)
    assert len(ours) == len(ref)
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= RESUME_TOLERANCE


@pytest.mark.slow
def test_shutdown_stop_under_mpirun_queues_the_job_and_its_resume_matches(
    dp2: JobDir, jobs_root: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """What a control plane's SIGTERM does to a 2-rank local job: the marker alone (mpirun would SIGKILL ranks
    1 s after forwarding a signal) stops both ranks with their state saved; the restart's reconcile resumes it."""
    # Staged under tmp_path: no control plane runs here to remove the staged copies (`staging_cleared`).
    settings = Settings(home=tmp_path / "home", model=str(tiny_model_dir), server={"port": 0},
                        training={"staging_dir": str(tmp_path)})  # fmt: skip
    launcher = LocalLauncher(settings)
    job = make_job(jobs_root, "shutdown-dp2", tiny_model_dir, rows(), **DP2_ARGS)
    launcher.submit(job, job.read_config())
    wait_for(lambda: len(job.read_metrics()) >= 5 or launcher.state(job)[0] != "running", 300, "5 steps")
    assert launcher.state(job)[0] == "running", launcher.logs(job)[-3000:]

    assert launcher.stop_for_shutdown([job]) == [job.job_id]

    status = job.read_status()
    assert status.status == "QUEUED" and "by the control plane's shutdown; state saved" in status.reason, status
    saved = json.loads((job.state_dir / "latest.json").read_text())["step"]
    assert saved == status.step and 5 <= saved < TRAIN_ARGS["max_steps"]
    assert launcher.state(job)[0] == "finished"

    resumed = reconcile_job(job, {"local": launcher})
    assert resumed is not None and resumed.resumes == 1
    wait_for(lambda: job.read_status().terminal, 300, "the resumed job to finish")
    assert job.read_status().status == "COMPLETED", launcher.logs(job)[-3000:]
    ours, ref = losses(job), losses(dp2)
    assert len(ours) == len(ref)
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= RESUME_TOLERANCE


def test_cancel_request_stops_the_job_as_cancelled(jobs_root: Path, tiny_model_dir: Path) -> None:
    job = make_job(jobs_root, "cancelled", tiny_model_dir, qa_rows(), **{**TRAIN_ARGS, "max_steps": 100_000})
    proc = start_trainer(job)
    try:
        wait_for(lambda: len(job.read_metrics()) >= 1 or proc.poll() is not None, 300, "the first step")
        (job.root / "cancel.requested").touch()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    status = job.read_status()
    assert status.status == "CANCELLED", trainer_output(job)
    assert status.reason.startswith("cancelled at step")
    assert (job.state_dir / "latest.json").exists()


def test_bad_row_fails_before_training_naming_the_line(jobs_root: Path, tiny_model_dir: Path) -> None:
    good = json.dumps({"input": "a", "output": "b"})
    text = f"{good}\n{good}\n{json.dumps({'input': 'a', 'output': 7})}\n{good}\n"
    job = make_job(jobs_root, "badrow", tiny_model_dir, text, **TRAIN_ARGS)
    assert run_trainer(job) == 1
    status = job.read_status()
    assert status.status == "FAILED"
    assert "line 3" in status.reason and "'output'" in status.reason, status.reason
    assert job.read_metrics() == []


@pytest.mark.parametrize("model", ["llama", "deepseek-v3", "seed-oss"])
def test_gradient_checkpointing_recomputes_activations_with_the_same_gradients(
        model: str, tiny_model_dir: Path, family_models: dict[str, Path]) -> None:  # fmt: skip
    """In one forward + backward: the same loss and gradients, a fraction of the activations kept for backward; also
    with multi-latent attention (its RoPE module reads the model's position ids again in the recomputed forward),
    sigmoid-routed experts and their frozen bias, and dropout (Seed-OSS's: the recomputed forward draws the same
    masks)."""
    import subprocess
    import sys

    from trainer_jobs import mpi_env

    script = Path(__file__).with_name("recompute_check.py")
    model_dir = tiny_model_dir if model == "llama" else family_models[model]
    proc = subprocess.run([sys.executable, str(script), str(model_dir)], env=mpi_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    assert result["loss_diff"] == 0.0 and result["grad_diff"] < 1e-6, result
    assert result["saved_recompute"] < 0.5 * result["saved_plain"], result


def test_gradient_checkpointing_job_reproduces_the_loss_curve(reference: JobDir, jobs_root: Path,
                                                               tiny_model_dir: Path) -> None:  # fmt: skip
    job = make_job(jobs_root, "recompute", tiny_model_dir, rows(), **TRAIN_ARGS, gradient_checkpointing=True)
    assert run_trainer(job) == 0, trainer_output(job)
    ours, theirs = losses(job), losses(reference)
    assert len(ours) == len(theirs) == TRAIN_ARGS["max_steps"]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < RESUME_TOLERANCE


def test_a_gpu_job_where_no_gpu_is_visible_fails_not_trains_on_cpu(jobs_root: Path, tiny_model_dir: Path) -> None:
    """A job that asks for GPUs where torch sees none (no driver, or device variables that hide them all, as ROCm's
    renumbering can) fails at once naming the device variables: it used to train on the node's CPU unnoticed."""
    job = make_job(jobs_root, "no-gpu", tiny_model_dir, rows(), **{**TRAIN_ARGS, "gpus": 1})
    assert run_trainer(job) == 1, trainer_output(job)
    status = job.read_status()
    assert status.status == "FAILED" and "asks for 1 GPU(s) a node and torch sees none" in status.reason, status
    assert "ROCR_VISIBLE_DEVICES" in status.reason and not job.read_metrics()


def test_gradient_checkpointing_trains_lora_adapters_as_without(jobs_root: Path, tiny_model_dir: Path) -> None:
    """With the base frozen, a recomputed layer's checkpoint tracked no gradient and the adapters got none (the job
    failed at its first backward): the same LoRA job with and without recompute now gives the same curve."""
    args = {**TRAIN_ARGS, "adapter_type": "lora", "max_steps": 3}
    curves = []
    for recompute in (False, True):
        job = make_job(jobs_root, f"lora-recompute-{recompute}", tiny_model_dir, rows(), **args,
                       gradient_checkpointing=recompute)  # fmt: skip
        assert run_trainer(job) == 0, trainer_output(job)
        curves.append(losses(job))
    assert len(curves[1]) == 3 and max(abs(a - b) for a, b in zip(*curves)) < RESUME_TOLERANCE, curves
    assert curves[1][-1] != curves[1][0]  # the adapters trained


def test_every_step_is_in_tensorboard_event_files_beside_the_metrics(reference: JobDir) -> None:
    """Read back with TensorBoard's own reader: each metric of metrics.jsonl is a scalar curve by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(reference.root / "tensorboard"))
    board.Reload()
    rows = reference.read_metrics()
    for name in ("loss", "lr", "tokens_per_second"):
        events = board.Scalars(f"train/{name}")
        assert [e.step for e in events] == [r["step"] for r in rows]
        assert [e.value for e in events] == pytest.approx([r[name] for r in rows], rel=1e-6)


def _eval_loss(model_dir: Path, rows: list[dict]) -> float:
    """transformers' eval-mode (no dropout) loss on `rows` as the trainer tokenizes them: the mean cross-entropy over
    every completion token of the batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scalarlm.protocol.rows import parse_row
    from scalarlm.training.data import encode_row

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for i, row in enumerate(rows):
        doc = encode_row(tokenizer, parse_row(json.dumps(row), i + 1))
        ids, targets = torch.tensor([doc.tokens]), torch.tensor(doc.targets[1:])
        with torch.no_grad():
            losses_ = torch.nn.functional.cross_entropy(ref(ids).logits[0, :-1], ids[0, 1:], reduction="none")
        total, count = total + losses_[targets].sum().item(), count + int(targets.sum())
    return total / count


@pytest.mark.parametrize("family", ["seed-oss", "starcoder2"])
def test_checkpoint_dropout_is_trained_and_disable_dropout_turns_it_off(
        jobs_root: Path, family_models: dict[str, Path], family: str) -> None:  # fmt: skip
    """Seed-OSS's and StarCoder2's checkpoints set dropout 0.1 (StarCoder2's on the embeddings too): a job trains with
    it, as transformers does (step 1's loss is not the eval-mode loss), and TRL's `disable_dropout` trains without it
    (step 1's loss is transformers' eval-mode loss on the same tokens)."""
    model, rows = family_models[family], qa_rows()[:4]
    args = dict(max_steps=1, learning_rate=1e-4, batch_size=4, max_seq_len=32, adapter_type="full", seed=0,
                steps_per_checkpoint=1)  # fmt: skip
    jobs = {flag: make_job(jobs_root, f"{family}-{flag}", model, rows, disable_dropout=flag, **args)
            for flag in (False, True)}  # fmt: skip
    for job in jobs.values():
        assert run_trainer(job) == 0, trainer_output(job)
    expected = _eval_loss(model, rows)
    assert abs(losses(jobs[True])[0] - expected) < 1e-5, (losses(jobs[True]), expected)
    assert abs(losses(jobs[False])[0] - expected) > 1e-3, (losses(jobs[False]), expected)
