"""The trainer's share of a GRPO step (issue 13): one `python -m scalarlm.training` GRPO job on bench/grpo.py's batch
shape (PROMPTS_PER_STEP prompts x GROUP sampled completions of 1..COMPLETION tokens, sampling logprobs, clip 0.2,
no KL), on the benchmark model. Prints the median `step_seconds` of steps 2..N (step 1 warms up) and the box's
load average. Not a test and no ratio: run it on two trees (e.g. `--tree` an extracted older commit) in one window to
compare them; `bench/grpo.py` measures the whole loop against TRL. The default model is the test suite's tiny one
(built under build/bench/model-tiny); `--model build/bench/model-40m` runs bench/grpo.py's.

    python -m bench.grpo_step [--steps 8] [--tree DIR] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, python
from bench.grpo import COMPLETION, GROUP, PROMPTS_PER_STEP, load, prompts
from bench.training import make_model

TINY = ROOT / "build" / "bench" / "model-tiny"


def rows(tokenizer_dir: Path, steps: int, seed: int = 0) -> list[dict]:
    """`steps` groups-per-step worth of scored rows with random completion ids and logprobs (lengths differ)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    out = []
    for p, prompt in enumerate(prompts(PROMPTS_PER_STEP * steps, seed)):
        for _ in range(GROUP):
            ids = [rng.randrange(3, len(tok)) for _ in range(rng.randint(1, COMPLETION))]
            out.append({"prompt": prompt, "completion": tok.decode(ids), "completion_token_ids": ids,
                        "logprobs": [-rng.random() * 3 for _ in ids], "reward": rng.random(), "group": f"{p}"})
    return out


def run(tree: Path, model: Path, steps: int) -> dict:
    """One GRPO job of `steps` steps with the trainer code of `tree`; its step times."""
    from scalarlm.checkpoint import JobDir
    from scalarlm.protocol.training import TrainArgs, TrainJobConfig

    work = Path(tempfile.mkdtemp(prefix="bench-grpo-step-", dir=ROOT / "build" / "bench"))
    job = JobDir(work / "job")
    job.create()
    args = TrainArgs(loss="grpo", learning_rate=5e-5, clip_eps=0.2, kl_coef=0.0, max_seq_len=128, dtype="float32",
                     lr_schedule="constant", batch_size=PROMPTS_PER_STEP, max_steps=steps, steps_per_checkpoint=10_000,
                     shuffle=False)  # fmt: skip
    job.write_config(TrainJobConfig(job_id="grpo-step", base_model=str(model), train_args=args))
    job.dataset_path.write_text("".join(json.dumps(r) + "\n" for r in rows(model, steps)))
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    before = load()
    # cwd = the tree: `python -m` puts the working directory first on sys.path, before PYTHONPATH.
    proc = subprocess.run([python(), "-m", "scalarlm.training", str(job.root)], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"trainer exited with {proc.returncode}: {proc.stderr[-2000:]}")
    metrics = job.read_metrics()
    times = [m["step_seconds"] for m in metrics[1:]]
    return {"tree": str(tree), "median_step_seconds": round(statistics.median(times), 4), "step_seconds": times,
            "tokens": metrics[-1]["tokens"], "load_before": before, "load_after": load()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tree", type=Path, default=ROOT, help="a checkout whose scalarlm/ package runs the trainer")
    ap.add_argument("--model", type=Path, default=TINY)
    args = ap.parse_args()
    model = args.model.resolve()
    if model == TINY and not (TINY / "config.json").exists():
        from scalarlm.cli.tiny_model import make_tiny_model

        make_tiny_model(TINY)
    result = run(args.tree.resolve(), model if model == TINY else make_model(model), args.steps)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    main()
