"""The GPU check: scalarlm's trainer on CUDA in bf16 beside Hugging Face's `Trainer`, on one GPU, in minutes.

Run it with `scripts/gpu_check.sh` (which brings the wheels), or `python -m bench.gpu_check` where megatron-core,
transformers and CUDA torch are installed. It needs no vLLM and no network. Steps, top to bottom:

1. A random ~0.6B model of Qwen3-0.6B's shape (28 layers, hidden 1024, 16 q / 8 kv heads of 128, vocab 151936,
   tied embeddings), built offline from its transformers config and saved in bf16, with a word-level tokenizer
   (one token per word, so every row has a known length).
2. SFT rows of ~1.9k tokens (prompt + completion), one per packed block of `--seq-len`.
3. scalarlm's trainer (`python -m scalarlm.training <job_dir>`, one rank: CUDA, bf16, NCCL, megatron's
   distributed optimizer) runs `--steps` steps of `--batch` blocks, publishing a checkpoint midway and at the end.
4. HF `Trainer` trains the same model on the same tokenized rows (same batch, steps, LR; fp32 master weights
   with bf16 autocast, fused AdamW, SDPA attention), timed per step the same way.
5. Resume: the same job again, stopped by the shutdown marker (state saved) and relaunched; its losses after the
   resume are compared with the uninterrupted run.
6. GRPO: a full-weight GRPO job on the same model (`--batch` groups of GRPO_GROUP completions per step, each
   group's prompt computed once, padding-free), `--grpo-steps` steps, publishing at its last step.

Prints one JSON line: tokens/s and MFU of both sides (MFU = (6 N + 6 L H s) tokens/s over the bf16 matmul peak
measured in this process; N the matmul parameters, L layers, H the attention width, s the mean document
length, the attention span of both sides), the optimizer the trainer used, the checkpoint publish time, the
resume check, and the GRPO job's step time, its rows' tokens/s and losses. Without CUDA it prints a line saying so
and exits 0 (`--cpu-smoke` runs the same plumbing on a tiny model on CPU, for tests; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, use_sliding_window=False, attention_bias=False,
)  # fmt: skip
TINY = dict(QWEN3_0_6B, vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64)  # fmt: skip
WORDS = 4000
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WARMUP_STEPS = 3  # steps left out of the per-step medians (allocator, cuBLAS heuristics, first NCCL calls)
GRPO_GROUP = 8  # completions per prompt in the GRPO job


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="blocks (one row each) per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--grpo-steps", type=int, default=10, help="steps of the GRPO job (0: no GRPO job)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the plumbing only")
    p.add_argument("--trainer-timeout", type=float, default=240.0, help="seconds one trainer run may take")
    return p.parse_args(argv)


# ---- model, tokenizer, rows ----------------------------------------------------------------------


def write_tokenizer(model_dir: Path) -> Any:
    """A word-level tokenizer ("w0".."w3999" one token each; prompts start with <s>) saved with the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + [f"w{i}" for i in range(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")  # fmt: skip
    fast.save_pretrained(model_dir)
    return fast


def write_model(model_dir: Path, shape: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A random Qwen3 of `shape` saved in `dtype` (Qwen3's own init: normal, std 0.02); returns its facts."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = write_tokenizer(model_dir)
    config = Qwen3Config(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    device = "cuda" if dtype == "bfloat16" and torch.cuda.is_available() else "cpu"  # initialising 0.6B is faster there
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(model_dir)
    facts = {"family": "qwen3", "params": sum(p.numel() for p in model.parameters()), **layout(shape)}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return facts


def layout(shape: dict[str, Any]) -> dict[str, int]:
    """The model's matmul parameters per token (q/k/v/o, MLP, LM head), layers and attention width."""
    d, hd, ff = shape["hidden_size"], shape["head_dim"], shape["intermediate_size"]
    q, kv, layers = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd, shape["num_hidden_layers"]
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * ff
    return {"matmul_params": layers * per_layer + shape["vocab_size"] * d, "layers": layers, "attn_width": q,
            "hidden": d}  # fmt: skip


def write_rows(path: Path, count: int, seq_len: int) -> int:
    """`count` SFT rows of random words filling ~93% of a block (prompt 1/8); returns the tokens per row."""
    import random

    rng = random.Random(0)
    total = int(seq_len * 0.93) - 2  # <s> and </s>
    prompt = total // 8
    with path.open("w") as f:
        for _ in range(count):
            words = random_words(rng, total)
            f.write(json.dumps({"input": " ".join(words[:prompt]), "output": " ".join(words[prompt:])}) + "\n")
    return total + 2


def random_words(rng: Any, n: int) -> list[str]:
    """`n` words of the tokenizer's vocabulary (one token each), drawn from `rng`."""
    return [f"w{rng.randrange(WORDS)}" for _ in range(n)]


def write_grpo_rows(path: Path, groups: int, seq_len: int) -> None:
    """`groups` GRPO groups of GRPO_GROUP scored completions: a prompt of a quarter block, completions of an eighth
    to half a block, rewards uniform in [0, 1)."""
    import random

    rng = random.Random(1)
    with path.open("w") as f:
        for _ in range(groups):
            prompt = " ".join(random_words(rng, seq_len // 4))
            for _ in range(GRPO_GROUP):
                completion = " ".join(random_words(rng, rng.randrange(seq_len // 8, seq_len // 2)))
                f.write(json.dumps({"prompt": prompt, "completion": completion, "reward": rng.random()}) + "\n")


# ---- scalarlm's trainer ------------------------------------------------------------------------------


def write_job(job_dir: Path, model_dir: Path, dataset: Path, args: argparse.Namespace, job_id: str,
              **overrides: Any) -> None:  # fmt: skip
    """jobs/<id>/ as the control plane writes it: job.yaml (a validated TrainJobConfig) and dataset.jsonl."""
    from scalarlm.checkpoint import JobDir
    from scalarlm.protocol.training import TrainArgs, TrainJobConfig

    train_args = TrainArgs(**{
        "max_steps": args.steps, "learning_rate": args.lr, "batch_size": args.batch, "adapter_type": "full",
        "dtype": "float32" if args.cpu_smoke else "bfloat16", "gpus": 0 if args.cpu_smoke else 1,
        "max_seq_len": args.seq_len, "lr_schedule": "constant", "steps_per_checkpoint": args.steps // 2,
        "shuffle": True, "seed": 0, **overrides,
    })  # fmt: skip
    job = JobDir(job_dir)
    job.create()
    job.write_config(TrainJobConfig(job_id=job_id, base_model=str(model_dir), train_args=train_args,
                                    dataset_rows=sum(1 for _ in dataset.open()), created=time.time()))  # fmt: skip
    shutil.copyfile(dataset, job.dataset_path)


def run_trainer(job_dir: Path, timeout: float, stop_after_step: int | None = None) -> dict[str, Any]:
    """Run one rank of the job as the local launcher does; optionally ask it to stop after a step."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.time()
    log = job_dir / "trainer.stderr"  # a file, not a pipe: a full pipe would stall the trainer
    with log.open("a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "scalarlm.training", str(job_dir)], env=env,
                                stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    marker = job_dir / "shutdown.requested"
    while proc.poll() is None:
        if time.time() - started > timeout:
            proc.kill()
            raise RuntimeError(f"trainer ran past {timeout:.0f} s: see {job_dir}/logs/rank-0.log")
        if stop_after_step is not None and not marker.exists() and last_step(job_dir) >= stop_after_step:
            marker.write_text("gpu check: stop and save state\n")
        time.sleep(0.05)
    status = json.loads((job_dir / "status.json").read_text())
    if proc.returncode != 0 or status["status"] not in {"COMPLETED", "QUEUED"}:
        raise RuntimeError(f"trainer exit {proc.returncode}, status {status['status']}: {status.get('reason')}\n"
                           f"{log.read_text()[-3000:]}")  # fmt: skip
    marker.unlink(missing_ok=True)
    return {"status": status["status"], "wall_s": time.time() - started, "started": started}


def metrics(job_dir: Path) -> list[dict[str, Any]]:
    path = job_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def steady(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Median seconds and tokens per step, the first WARMUP_STEPS left out (all of them in a shorter run)."""
    timed = rows[WARMUP_STEPS:] or rows
    return statistics.median(r["step_seconds"] for r in timed), statistics.median(r["tokens"] for r in timed)


def last_step(job_dir: Path) -> int:
    rows = metrics(job_dir)
    return int(rows[-1]["step"]) if rows else 0


def publish_seconds(job_dir: Path, step: int) -> float:
    """From the end of `step` (its metrics row) to the last file written in checkpoints/step-<step>/."""
    row = next(r for r in metrics(job_dir) if r["step"] == step)
    folder = job_dir / "checkpoints" / f"step-{step}"
    return max(p.stat().st_mtime for p in folder.iterdir()) - float(row["time"])


def optimizer_kind(job_dir: Path) -> str:
    """Which optimizer the trainer saved: megatron's distributed optimizer or torch AdamW (CPU)."""
    import torch

    latest = json.loads((job_dir / "state" / "latest.json").read_text())
    payload = torch.load(job_dir / "state" / f"step-{latest['step']}" / "rank-0.pt", map_location="cpu", mmap=True,
                         weights_only=False)  # fmt: skip
    keys = set(payload["optimizer"])
    return "megatron-distributed" if {"megatron", "param_state"} <= keys else "torch-adamw" if "adamw" in keys else str(keys)


def ours(work: Path, model_dir: Path, dataset: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The uninterrupted run: per-step throughput, publish time, optimizer kind, startup time."""
    job_dir = work / "jobs" / "ours"
    write_job(job_dir, model_dir, dataset, args, "gpu-check-ours")
    run = run_trainer(job_dir, args.trainer_timeout)
    rows = metrics(job_dir)
    step_s, tokens = steady(rows)
    first_step_start = float(rows[0]["time"]) - float(rows[0]["step_seconds"])
    result = {
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        "tokens_per_step": tokens,
        "losses": [r["loss"] for r in rows],
        "startup_s": first_step_start - run["started"],
        "wall_s": run["wall_s"],
        "publish_s": {str(s): publish_seconds(job_dir, s) for s in (args.steps // 2, args.steps)},
        "checkpoint_bytes": sum(p.stat().st_size for p in (job_dir / "checkpoints" / f"step-{args.steps}").iterdir()),
        "optimizer": optimizer_kind(job_dir),
    }
    shutil.rmtree(job_dir / "state", ignore_errors=True)  # ~14 bytes a parameter: keep the disk for the resume run
    return result


def resume(work: Path, model_dir: Path, dataset: Path, args: argparse.Namespace, reference: list[float]) -> dict:
    """The same job stopped after a few steps (state saved, QUEUED) and relaunched: does it continue the curve?"""
    job_dir = work / "jobs" / "resume"
    write_job(job_dir, model_dir, dataset, args, "gpu-check-resume")
    first = run_trainer(job_dir, args.trainer_timeout, stop_after_step=max(2, args.steps // 3))
    stopped_at = last_step(job_dir)
    second = run_trainer(job_dir, args.trainer_timeout)
    rows = metrics(job_dir)
    after = {int(r["step"]): r["loss"] for r in rows if r["step"] > stopped_at}
    diffs = [abs(loss - reference[step - 1]) for step, loss in after.items()]
    return {
        "stopped_status": first["status"],
        "stopped_at_step": stopped_at,
        "final_status": second["status"],
        "steps_after_resume": sorted(after) == list(range(stopped_at + 1, args.steps + 1)),
        "max_loss_diff_vs_uninterrupted": max(diffs) if diffs else None,
        "restart_to_first_step_s": float(rows[-len(after)]["time"]) - float(rows[-len(after)]["step_seconds"])
        - second["started"] if after else None,
    }  # fmt: skip


def grpo(work: Path, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A full-weight GRPO job: per-step time, its rows' tokens per second (each row's prompt and completion, as a
    trainer without prompt sharing computes them: the GRPO `tokens` metric), losses."""
    import math

    job_dir = work / "jobs" / "grpo"
    dataset = work / "grpo_rows.jsonl"
    write_grpo_rows(dataset, args.grpo_steps * args.batch, args.seq_len)
    write_job(job_dir, model_dir, dataset, args, "gpu-check-grpo", loss="grpo", max_steps=args.grpo_steps,
              steps_per_checkpoint=args.grpo_steps)  # fmt: skip
    run = run_trainer(job_dir, args.trainer_timeout)
    rows = metrics(job_dir)
    step_s, tokens = steady(rows)
    shutil.rmtree(job_dir / "state", ignore_errors=True)
    return {
        "status": run["status"], "steps": len(rows), "step_s": step_s, "row_tokens_per_step": tokens,
        "row_tokens_per_s": tokens / step_s, "losses_finite": all(math.isfinite(r["loss"]) for r in rows),
        "losses": [r["loss"] for r in rows], "publish_s": publish_seconds(job_dir, args.grpo_steps),
        "wall_s": run["wall_s"],
    }  # fmt: skip


# ---- Hugging Face Trainer baseline -------------------------------------------------------------------


def hf_trainer(work: Path, model_dir: Path, dataset: Path, args: argparse.Namespace) -> dict[str, Any]:
    """HF `Trainer` on the same tokenized rows (scalarlm's own row encoding), batch, steps and LR."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from scalarlm.training.data import encode_row
    from scalarlm.training.rows import read_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    docs = [encode_row(tokenizer, row) for row in read_rows(dataset)]
    examples = [{"input_ids": list(d.tokens), "labels": [t if m else -100 for t, m in zip(d.tokens, d.targets)]}
                for d in docs]  # fmt: skip
    cuda = torch.cuda.is_available() and not args.cpu_smoke

    def collate(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        pad = lambda xs, v: [x + [v] * (width - len(x)) for x in xs]  # noqa: E731
        ids = torch.tensor(pad([b["input_ids"] for b in batch], tokenizer.pad_token_id))
        return {"input_ids": ids, "labels": torch.tensor(pad([b["labels"] for b in batch], -100)),
                "attention_mask": (torch.arange(width)[None] < torch.tensor([[len(b["input_ids"])] for b in batch]))
                .long()}  # fmt: skip

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.begin = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.begin = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.begin)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    timer = StepTimer()
    training_args = TrainingArguments(
        output_dir=str(work / "hf"), per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=cuda, optim="adamw_torch_fused" if cuda else "adamw_torch", save_strategy="no", report_to=[],
        logging_steps=max(1, args.steps), dataloader_num_workers=0, remove_unused_columns=False, seed=0,
        use_cpu=not cuda,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=examples, data_collator=collate,
                      callbacks=[timer])  # fmt: skip
    trainer.train()
    timed = timer.times[WARMUP_STEPS:] or timer.times
    tokens = statistics.mean(len(e["input_ids"]) for e in examples) * args.batch
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"tokens_per_s": tokens / statistics.median(timed), "step_s": statistics.median(timed),
            "tokens_per_step": tokens}  # fmt: skip


# ---- figures -------------------------------------------------------------------------------------------


def matmul_peak_tflops() -> float:
    """bf16 dense matmul throughput of this GPU (8192^3, best of a few), the MFU denominator."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / 10)
    return 2 * 8192**3 / best / 1e12


def mfu(tokens_per_s: float, facts: dict[str, Any], doc_len: float, peak_tflops: float | None) -> float | None:
    flops_per_token = 6 * facts["matmul_params"] + 6 * facts["layers"] * facts["attn_width"] * doc_len
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12) if peak_tflops else None


def no_cuda_reason() -> str | None:
    """Why this machine cannot run the check, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device visible to torch {torch.__version__} (torch.cuda.is_available() is False)"
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        return f"megatron-core is not importable ({e}): run scripts/gpu_check.sh, which brings its wheel"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    reason = None if args.cpu_smoke else no_cuda_reason()
    if reason:
        print(json.dumps({"ok": False, "skipped": f"GPU check skipped: {reason}"}))
        return 0
    import megatron.core
    import torch
    import transformers

    work = args.work or Path(tempfile.mkdtemp(prefix="scalarlm-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.cpu_smoke else QWEN3_0_6B
    model_dir = work / "model"
    facts = write_model(model_dir, shape, "float32" if args.cpu_smoke else "bfloat16")
    dataset = work / "rows.jsonl"
    doc_len = write_rows(dataset, args.steps * args.batch, args.seq_len)
    built = time.time()

    peak = None if args.cpu_smoke else matmul_peak_tflops()
    mine = ours(work, model_dir, dataset, args)
    baseline = hf_trainer(work, model_dir, dataset, args)
    resumed = resume(work, model_dir, dataset, args, mine.pop("losses"))
    rl = grpo(work, model_dir, args) if args.grpo_steps else None
    report = {
        "ok": mine["optimizer"] == ("torch-adamw" if args.cpu_smoke else "megatron-distributed")
        and resumed["final_status"] == "COMPLETED" and resumed["steps_after_resume"]
        and (rl is None or (rl["status"] == "COMPLETED" and rl["steps"] == args.grpo_steps and rl["losses_finite"])),
        "check": "cpu-smoke (plumbing only; figures mean nothing)" if args.cpu_smoke else "gpu",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu_smoke else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "megatron_core": megatron.core.__version__, "python": sys.version.split()[0]},
        "model": facts,
        "data": {"rows": args.steps * args.batch, "tokens_per_row": doc_len, "seq_len": args.seq_len,
                 "batch": args.batch, "steps": args.steps},
        "matmul_peak_tflops": peak,
        "scalarlm": {**mine, "mfu": mfu(mine["tokens_per_s"], facts, doc_len, peak)},
        "hf_trainer": {**baseline, "mfu": mfu(baseline["tokens_per_s"], facts, doc_len, peak)},
        "tokens_per_s_ratio": mine["tokens_per_s"] / baseline["tokens_per_s"],
        "resume": resumed,
        "grpo": rl,
        "build_s": built - started,
        "total_s": time.time() - started,
    }  # fmt: skip
    print(json.dumps(report, default=float))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
