"""GRPO benchmark (issue 4): our GRPO step time ÷ TRL `GRPOTrainer` (HF-generate mode, `use_cpu=True`).

Both sides start from the same ~39M-parameter model (bench/training.py's), sample GROUP completions of at most
COMPLETION tokens for each of PROMPTS_PER_STEP prompts per step at temperature 1, score them with the same reward
(the share of digit characters in the completion: a random model gets partial credit, so groups have spread), and
take one optimizer step with the GRPO loss (beta 0, clip 0.2, same learning rate). Our step is the whole client loop:
generate through `scalarlm serve` (n=GROUP, sampling logprobs) + score on the client + one RL-session step (which
answers once the new weights are published and served). Step time on both sides = wall time from the end of step 1
to the end of step N ÷ (N - 1); start-up and the warm-up step are left out. Not a test: prints a ratio measured in
this one run, and both reward curves.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, Process, drop_weights, free_port, merge_results, python
from bench.training import make_model

PROMPTS_PER_STEP = 4
GROUP = 8
COMPLETION = 16
LR = 5e-5
CLIP = 0.2
START_SECONDS = 900


def prompts(n: int = 64, seed: int = 0) -> list[str]:
    """Arithmetic questions (the model's tokenizer knows digits and these words)."""
    rng = random.Random(seed)
    return [f"Count the apples: what is {rng.randrange(40)} + {rng.randrange(40)}? " for _ in range(n)]


def digit_frac(text: str) -> float:
    """Share of digit characters in the completion (0 for an empty one)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# --- TRL: `python -m bench.grpo --trl` runs GRPOTrainer in a fresh process and prints JSON ---


def trl_grpo(model: Path, steps: int, out_dir: Path, prompts: list[str], score, lr: float = LR,
             shuffle: bool = True, seed: int = 0) -> tuple[list[float], list[float], Any, Any]:  # fmt: skip
    """TRL GRPOTrainer on `prompts` with `score(prompt, completion, completion_ids) -> reward`: HF generate (no
    vLLM), CPU, fp32, this file's batch shape and loss, sampling seeded with `seed`; returns (each step's mean reward,
    each step's end time, the trained model, its tokenizer)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    rewards: list[float] = []
    ends: list[float] = []

    def reward(prompts, completions, completion_ids, **kwargs):
        scores = [score(p, c, ids) for p, c, ids in zip(prompts, completions, completion_ids)]
        rewards.append(statistics.fmean(scores))
        return scores

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    cfg = GRPOConfig(output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
                     num_generations=GROUP, max_completion_length=COMPLETION, temperature=1.0, learning_rate=lr,
                     lr_scheduler_type="constant", beta=0.0, epsilon=CLIP, loss_type="grpo", use_cpu=True, bf16=False,
                     report_to="none", save_strategy="no", logging_steps=10_000, seed=seed, disable_tqdm=True,
                     dataloader_num_workers=0, shuffle_dataset=shuffle)  # fmt: skip
    data = Dataset.from_list([{"prompt": p} for p in prompts])
    trainer = GRPOTrainer(model=lm, reward_funcs=[reward], args=cfg, train_dataset=data, processing_class=tokenizer,
                          callbacks=[StepClock()])  # fmt: skip
    trainer.train()
    return rewards, ends, lm, tokenizer


def run_trl(model: Path, steps: int, out_dir: Path) -> dict:
    """This file's TRL side: the digit-share reward on the arithmetic prompts; per-step time and rewards."""
    lengths: list[int] = []

    def score(prompt: str, completion: str, ids: list[int]) -> float:
        lengths.append(len(ids))  # generated tokens, not re-tokenized text
        return digit_frac(completion)

    rewards, ends, _, _ = trl_grpo(model, steps, out_dir, prompts(), score)
    return {"seconds_per_step": (ends[-1] - ends[0]) / (len(ends) - 1), "steps": len(ends), "rewards": rewards,
            "mean_completion_tokens": statistics.fmean(lengths)}  # fmt: skip


def start_trl(model: Path, steps: int, work: Path) -> subprocess.Popen:
    """Start the TRL side in a fresh process; its JSON goes to trl.json, its log to trl.log."""
    return subprocess.Popen([python(), "-m", "bench.grpo", "--trl", "--model", str(model), "--steps", str(steps),
                             "--work", str(work)], cwd=ROOT, stdout=open(work / "trl.json", "w"),
                            stderr=open(work / "trl.log", "w"), start_new_session=True)  # fmt: skip


def finish_trl(proc: subprocess.Popen, work: Path, timeout: float) -> dict:
    """Wait for the TRL side (killed after `timeout` s) and read its result."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"TRL GRPO exited with {rc}; see {work / 'trl.log'}")
    return json.loads((work / "trl.json").read_text().strip().splitlines()[-1])


# --- ours: scalarlm serve + client generate + client-side reward + RL session step ---


def session_missing() -> str | None:
    """Why our side cannot run yet (the trainer does not take session jobs), or None when it can."""
    trainer_files = "".join(p.read_text() for p in (ROOT / "scalarlm" / "training").glob("*.py"))
    if "session" not in trainer_files:
        return "scalarlm/training/ has no RL-session trainer yet (TrainJobConfig.session is not handled)"
    if not (ROOT / "scalarlm" / "server" / "routers" / "sessions.py").exists():
        return "no /v1/train/sessions routes"
    return None


class SlowStart(Process):
    """`Process` that waits up to START_SECONDS for health (vLLM start-up on a loaded 2-core box can pass 5 min)."""

    def __enter__(self) -> "SlowStart":
        out = open(self.log, "w") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + START_SECONDS
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"scalarlm serve exited with {self.proc.returncode}; see {self.log}")
            try:
                r = httpx.get(self.health_url, timeout=2)
                if r.status_code == 200 and r.json().get("all", "up") == "up":
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"{self.health_url} not healthy after {START_SECONDS} s")


def ours_side(model: Path, steps: int, work: Path) -> dict:
    """Our GRPO loop against a real `scalarlm serve` on the same model; per-step times and mean rewards."""
    import scalarlm

    port = free_port()
    argv = [python(), "-m", "scalarlm.cli", "serve", "--model", str(model), "--home", str(work / "home"),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    rng = random.Random(0)
    pool = prompts()
    rewards: list[float] = []
    lengths: list[int] = []
    ends: list[float] = []
    parts: list[dict] = []
    with SlowStart(argv, f"http://127.0.0.1:{port}/v1/health", log=work / "scalarlm-serve.log"):
        llm = scalarlm.ScalarLM(api_url=f"http://127.0.0.1:{port}", timeout=600)
        train_args = {"adapter_type": "full", "loss": "grpo", "learning_rate": LR, "clip_eps": CLIP, "kl_coef": 0.0,
                      "max_seq_len": 128, "dtype": "float32", "lr_schedule": "constant", "batch_size": 1}  # fmt: skip
        with llm.rl_session(train_args=train_args) as session:
            served: str | None = None  # the base model until the first step is published
            for step in range(steps):
                t0 = time.perf_counter()
                batch = rng.sample(pool, PROMPTS_PER_STEP)
                results = llm.generate(batch, model_name=served, max_tokens=COMPLETION, n=GROUP, temperature=1.0,
                                       logprobs=1, seed=rng.randrange(1 << 30), return_details=True)  # fmt: skip
                t1 = time.perf_counter()
                rows, scores = [], []
                for prompt, result in zip(batch, results):
                    for out in result.outputs or []:
                        scores.append(digit_frac(out.text))
                        lengths.append(len(out.token_ids) if getattr(out, "token_ids", None) else len(out.logprobs or []))
                        rows.append({"prompt": prompt, "completion": out.text, "reward": scores[-1], "group": prompt,
                                     "logprobs": out.logprobs, "completion_token_ids": out.token_ids})  # fmt: skip
                t2 = time.perf_counter()
                session.step(rows)
                served = session.model_name
                ends.append(time.perf_counter())
                rewards.append(statistics.fmean(scores))
                parts.append({"generate": t1 - t0, "score": t2 - t1, "train_publish": ends[-1] - t2})
    steady = parts[1:]
    return {"seconds_per_step": (ends[-1] - ends[0]) / (len(ends) - 1), "steps": len(ends), "rewards": rewards,
            "mean_completion_tokens": statistics.fmean(lengths) if lengths else 0.0,
            "generate_s": statistics.fmean(p["generate"] for p in steady),
            "train_publish_s": statistics.fmean(p["train_publish"] for p in steady)}  # fmt: skip


def curve(rewards: list[float]) -> str:
    return " ".join(f"{r:.3f}" for r in rewards)


def arguments(steps: int, timeout: float) -> argparse.ArgumentParser:
    """The options both GRPO benchmarks take (`--trl`: run only the TRL side, in this process)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--model", type=Path, default=ROOT / "build" / "bench" / "model-40m")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds allowed to the TRL side")
    ap.add_argument("--trl", action="store_true", help="run only the TRL side in this process (internal)")
    return ap


def main() -> None:
    ap = arguments(steps=10, timeout=900)
    ap.add_argument("--concurrent", action="store_true", help="run the TRL side at the same time as ours")
    args = ap.parse_args()
    if args.trl:
        print(json.dumps(run_trl(args.model, args.steps, args.work / "out-trl")))
        return
    model = make_model(args.model.resolve())
    work = Path(tempfile.mkdtemp(prefix="bench-grpo-", dir=ROOT / "build" / "bench"))
    print(f"model {model}; {PROMPTS_PER_STEP} prompts x {GROUP} completions x <= {COMPLETION} tokens per step, "
          f"{args.steps} steps; work {work}")  # fmt: skip
    figures: dict = {"grpo_step_vs_trl_digits": None}
    if args.concurrent:  # a loaded box: run both sides in the same window so they see the same contention
        trl_proc = start_trl(model, args.steps, work)
    ours = trl = None
    why = session_missing()
    if why is None:
        before = load()
        try:
            ours = ours_side(model, args.steps, work)
        except Exception as e:  # a benchmark reports what broke and still measures the baseline
            why = f"our GRPO loop failed: {type(e).__name__}: {e}"
    if ours is not None:
        print(f"ours (serve + session)         {ours['seconds_per_step']:7.2f} s/step  "
              f"(generate {ours['generate_s']:.2f} s, train+publish {ours['train_publish_s']:.2f} s)  "
              f"mean completion {ours['mean_completion_tokens']:.1f} tokens   load avg {before} -> {load()}")  # fmt: skip
        print(f"  reward curve: {curve(ours['rewards'])}")
        figures["grpo_ours_seconds_per_step"] = round(ours["seconds_per_step"], 3)
    else:
        print(f"ours: MISSING, not measured: {why}")
    before = load()
    try:
        if not args.concurrent:
            trl_proc = start_trl(model, args.steps, work)
        trl = finish_trl(trl_proc, work, args.timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"TRL GRPOTrainer: MISSING, not measured: {e}")
    if trl is not None:
        print(f"TRL GRPOTrainer (HF generate)  {trl['seconds_per_step']:7.2f} s/step  "
              f"mean completion {trl['mean_completion_tokens']:.1f} tokens   load avg {before} -> {load()}")  # fmt: skip
        print(f"  reward curve: {curve(trl['rewards'])}")
        figures["grpo_trl_seconds_per_step"] = round(trl["seconds_per_step"], 3)
    if ours is not None and trl is not None:
        figures["grpo_step_vs_trl_digits"] = round(ours["seconds_per_step"] / trl["seconds_per_step"], 3)
        print(f"grpo_step_vs_trl_digits = {figures['grpo_step_vs_trl_digits']} (sync; the async figure is bench.grpo_learn's grpo_step_vs_trl)")
    else:
        print("grpo_step_vs_trl_digits: MISSING (one side was not measured; no ratio recorded)")
    merge_results(figures)
    print(json.dumps(figures))
    drop_weights(work)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    main()
