"""A learnable GRPO comparison: ours (sync and async) and TRL `GRPOTrainer` on the same arithmetic task, from the
same SFT warm start, for the same number of steps; both reward curves in one PNG.

bench/grpo.py's setup (the ~39M-parameter model, PROMPTS_PER_STEP prompts x GROUP completions of at most COMPLETION
tokens at temperature 1, the GRPO loss with beta 0 and clip 0.2, one optimizer step per batch, constant LR) on
single-digit sums ("3+4=" -> "7", examples/rl_arithmetic.py's problems) with an exact-answer reward (1 when the
first number written is the sum). The warm start is one SFT job on our trainer over noisy answers (each problem
WARM_ROWS times, the right sum for half of them and a random one otherwise): it learns the format robustly and
leaves every sum uncertain (about 0.4 right at temperature 1, nearly every group of 8 mixed), which is what GRPO
can sharpen; see WARM_ROWS for what did not learn. Its published checkpoint is the start of all three runs: our RL
session one step at a time (sync), our session's `pipeline` (the next batch generated while the step trains,
`max_staleness` 1: async), and TRL in a fresh process. `grpo_step_vs_trl` is the async ratio,
`grpo_step_vs_trl_sync` the sync one (bench/grpo.py's digit-reward ratio is `grpo_step_vs_trl_digits`). Our trainer
leaves out the rows whose advantage is 0 (their gradient is exactly 0; TRL computes them):
`grpo_learn_rows_skipped_*` is the fraction of rows that were. Step time = wall time from the end of step 1 to the
end of step N / (N - 1).

Every side runs `--seeds` times (3), each seed its own order of prompts and its own sampling seeds (our async side
samples unseeded). A step's reward is over its 4 prompts, so one run's curve follows which prompts it drew; the
policy each run ends with is therefore also evaluated on every problem (EVAL_SAMPLES completions of each at
temperature 1, the same for the warm start): `grpo_learn_eval_reward_*`. Per side: the median seconds per step over
the seeds (the ratios), the final evaluation, and the training reward of the last third of the steps and its gain
over the first third, means over the seeds (`grpo_learn_reward_last_third_*`, `grpo_learn_reward_gain_*`; the
standard error over the seeds is printed beside them). Our sides run first, on one server; TRL's after it stops.
Prints the ratios measured in this run, the load average, and writes build/bench/grpo_reward_curves.png (mean curves
over the seeds). Not a test.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, drop_weights, free_port, merge_results, python
from bench.grpo import CLIP, COMPLETION, GROUP, PROMPTS_PER_STEP, SlowStart, arguments, finish_trl, load, trl_grpo
from bench.training import make_model

PROBLEMS = [(f"{a}+{b}=", str(a + b)) for a, b in itertools.product(range(5), repeat=2)]
ANSWERS = dict(PROBLEMS)
LR = 3e-5
SFT_STEPS = 20
SFT_LR = 3e-4
# The warm start's rows: each problem WARM_ROWS times, answered right with probability WARM_RIGHT, else with a random
# 0-8. Measured on this model (TRL from an HF replica of this warm start, 30 steps, 16 samples of each problem before
# and after): the warm start scores 0.42 with 24 of 25 groups mixed, and GRPO at 3e-5 takes it to 0.77-0.86 (3 seeds);
# at 1e-4 every group collapses to one answer within a few steps and the score stays 0.42. The earlier warm start (4
# steps on the right answers) scored 0.72 but most prompts were all right or all wrong, and every lr from 1e-4 to
# 1e-3 lost reward on it (on both sides): RL steps of that size undo a 4-step model.
WARM_ROWS = 32
WARM_RIGHT = 0.5
EVAL_SAMPLES = 16
PNG = ROOT / "build" / "bench" / "grpo_reward_curves.png"
_NUMBER = re.compile(r"\d+")


def answer_reward(completion: str, answer: str) -> float:
    """1.0 when the first number in the completion is the sum, else 0.0."""
    found = _NUMBER.search(completion)
    return 1.0 if found is not None and found.group() == answer else 0.0


def score_samples(samples: dict[str, list[str]]) -> float:
    """The mean exact-answer reward over every problem's completions."""
    return statistics.fmean(answer_reward(text, ANSWERS[p]) for p, texts in samples.items() for text in texts)


def batches(steps: int, seed: int = 0) -> list[list[str]]:
    """The prompts of every step, the same for every side."""
    rng = random.Random(seed)
    return [[p for p, _ in rng.sample(PROBLEMS, PROMPTS_PER_STEP)] for _ in range(steps)]


# --- TRL: `python -m bench.grpo_learn --trl` runs GRPOTrainer in a fresh process and prints JSON ---


def hf_samples(lm, tokenizer, seed: int) -> dict[str, list[str]]:
    """EVAL_SAMPLES completions of every problem from a transformers model at temperature 1 (no top-k or top-p, as
    vLLM samples ours)."""
    import torch

    torch.manual_seed(seed)
    lm.eval()
    samples = {}
    with torch.no_grad():
        for p, _ in PROBLEMS:
            ids = tokenizer([p] * EVAL_SAMPLES, return_tensors="pt")
            out = lm.generate(**ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=COMPLETION,
                              pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            samples[p] = tokenizer.batch_decode(out[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    return samples


def run_trl(model: Path, steps: int, out_dir: Path, seed: int = 0) -> dict:
    """TRL GRPOTrainer from the warm-start checkpoint on the same batches (in order); per-step times and rewards, and
    the evaluation of the policy it ends with."""
    plan = [p for batch in batches(steps, seed) for p in batch]
    rewards, ends, lm, tokenizer = trl_grpo(model, steps, out_dir, plan, lambda p, c, ids: answer_reward(c, ANSWERS[p]),
                                            LR, shuffle=False, seed=seed)  # fmt: skip
    return {"seconds_per_step": (ends[-1] - ends[0]) / (len(ends) - 1), "rewards": rewards,
            "seconds": [e - ends[0] for e in ends], "eval_reward": score_samples(hf_samples(lm, tokenizer, seed))}


# --- ours: one `scalarlm serve`; the warm start, then a sync and an async session from it ---


def _rows(batch: list[str], results: list) -> list[dict]:
    return [{"prompt": p, "completion": o.text, "reward": answer_reward(o.text, ANSWERS[p]), "group": p,
             "logprobs": o.logprobs, "completion_token_ids": o.token_ids}
            for p, r in zip(batch, results) for o in r.outputs or []]  # fmt: skip


def warm_rows(seed: int = 0) -> list[dict[str, str]]:
    """WARM_ROWS rows of each problem, right with probability WARM_RIGHT, shuffled."""
    rng = random.Random(seed)
    rows = [{"input": p, "output": a if rng.random() < WARM_RIGHT else str(rng.randrange(9))}
            for p, a in PROBLEMS for _ in range(WARM_ROWS)]  # fmt: skip
    rng.shuffle(rows)
    return rows


def warm_start(llm, home: Path) -> tuple[str, Path]:
    """One SFT job on noisy answers; its id and its published checkpoint (HF layout)."""
    rows = warm_rows()
    job = llm.train(rows, train_args={"adapter_type": "full", "learning_rate": SFT_LR, "max_seq_len": 32,
                                      "dtype": "float32", "lr_schedule": "constant", "batch_size": 8,
                                      "max_steps": SFT_STEPS, "steps_per_checkpoint": SFT_STEPS})  # fmt: skip
    job.wait(timeout=900, progress=False)
    step = job.info().checkpoints[-1]
    return job.id, home / "jobs" / job.id / "checkpoints" / f"step-{step}"


RL_ARGS = {"adapter_type": "full", "loss": "grpo", "learning_rate": LR, "clip_eps": CLIP, "kl_coef": 0.0,
           "max_seq_len": 64, "dtype": "float32", "lr_schedule": "constant", "batch_size": 1}  # fmt: skip
SAMPLING = {"n": GROUP, "temperature": 1.0, "logprobs": 1}


def ours_eval(llm, model_name: str, seed: int) -> float:
    """EVAL_SAMPLES completions of every problem from the served `model_name` at temperature 1, scored."""
    results = llm.generate([p for p, _ in PROBLEMS], model_name=model_name, max_tokens=COMPLETION, n=EVAL_SAMPLES,
                           temperature=1.0, seed=seed, return_details=True)  # fmt: skip
    return score_samples({p: [o.text for o in r.outputs or []] for (p, _), r in zip(PROBLEMS, results)})


def ours_sync(llm, start: str, steps: int, seed: int = 0) -> dict:
    """Generate, score, step, one after another."""
    rewards, ends, skipped = [], [], []
    rng = random.Random(1 + seed)
    with llm.rl_session(model_name=start, train_args=RL_ARGS, max_staleness=0) as session:
        served, version = start, 0
        for batch in batches(steps, seed):
            results = llm.generate(batch, model_name=served, max_tokens=COMPLETION, seed=rng.randrange(1 << 30),
                                   return_details=True, **SAMPLING)  # fmt: skip
            rows = _rows(batch, results)
            version = session.step(rows, version=version)
            served = session.model_name
            ends.append(time.perf_counter())
            rewards.append(statistics.fmean(r["reward"] for r in rows))
            skipped.append(session.last.metrics.get("rows_skipped", 0) / len(rows))
        final = ours_eval(llm, session.model_name, seed)
    return {"seconds_per_step": (ends[-1] - ends[0]) / (len(ends) - 1), "rewards": rewards,
            "seconds": [e - ends[0] for e in ends], "rows_skipped": statistics.fmean(skipped),
            "eval_reward": final}  # fmt: skip


def ours_async(llm, start: str, steps: int, seed: int = 0) -> dict:
    """`session.pipeline`: batch k+1 is generated while step k trains (one version stale)."""
    plan = batches(steps, seed)
    rewards, ends, staleness, skipped = [], [], [], []
    with llm.rl_session(model_name=start, train_args=RL_ARGS, max_staleness=1) as session:
        pipeline = session.pipeline(lambda i: plan[i], _rows, steps, max_tokens=COMPLETION, **SAMPLING)
        for s in pipeline:
            ends.append(time.perf_counter())
            rewards.append(statistics.fmean(r["reward"] for r in s.rows))
            staleness.append(s.response.staleness)
            skipped.append(s.response.metrics.get("rows_skipped", 0) / len(s.rows))
        final = ours_eval(llm, session.model_name, seed)
    return {"seconds_per_step": (ends[-1] - ends[0]) / (len(ends) - 1), "rewards": rewards,
            "seconds": [e - ends[0] for e in ends], "staleness": staleness,
            "rows_skipped": statistics.fmean(skipped), "eval_reward": final}  # fmt: skip


def _rolling(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def _mean_curve(runs: list[dict], key: str) -> list[float]:
    """The mean over seeds of each step's `key` (rewards, or seconds after step 1)."""
    return [statistics.fmean(values) for values in zip(*(run[key] for run in runs))]


def plot(sides: dict[str, list[dict]], steps: int, warm: float) -> None:
    """Mean reward curves by step and by time; stars: the evaluation of the warm start (step 0) and of each side's
    last policy (mean over the seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    seeds = len(next(iter(sides.values())))
    for name, runs in sides.items():
        rewards = _mean_curve(runs, "rewards")
        smooth = _rolling(rewards, 5)
        line = by_step.plot(range(1, len(smooth) + 1), smooth, label=f"{name} (mean of 5 steps)", linewidth=2)[0]
        by_step.plot(range(1, len(rewards) + 1), rewards, color=line.get_color(), alpha=0.3)
        by_step.scatter([steps], [statistics.fmean(r["eval_reward"] for r in runs)], color=line.get_color(), marker="*",
                        s=150, zorder=3)  # fmt: skip
        by_time.plot(_mean_curve(runs, "seconds"), smooth, color=line.get_color(), linewidth=2, label=name)
    by_step.scatter([0], [warm], color="black", marker="*", s=150, zorder=3,
                    label=f"evaluation: {EVAL_SAMPLES} samples of every problem")  # fmt: skip
    by_step.set(xlabel="step", ylabel=f"mean reward (exact sum), mean of {seeds} seed(s)",
                title=f"GRPO, {steps} steps from one SFT warm start")  # fmt: skip
    by_time.set(xlabel="seconds after step 1", ylabel="mean reward", title="the same against wall time")
    by_step.legend()
    fig.tight_layout()
    PNG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PNG, dpi=100)


def _key(name: str) -> str:
    """'ours sync' -> 'ours_sync', 'TRL GRPOTrainer' -> 'trl'."""
    return name.replace(" ", "_") if name.startswith("ours") else "trl"


def _thirds(rewards: list[float]) -> tuple[float, float]:
    tail = max(1, len(rewards) // 3)
    return statistics.fmean(rewards[:tail]), statistics.fmean(rewards[-tail:])


def _mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (nan from one value)."""
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def summarize(sides: dict[str, list[dict]]) -> dict[str, float]:
    """The figures over every seed: step-time ratios from each side's median seconds per step; each side's final
    evaluation, its reward in the last third of the steps and that reward's gain over the first third, means over the
    seeds (their standard error printed beside them: the curves follow which prompts each seed drew)."""
    per_step = {name: statistics.median(r["seconds_per_step"] for r in runs) for name, runs in sides.items()}
    trl = per_step["TRL GRPOTrainer"]
    figures = {"grpo_step_vs_trl": round(per_step["ours async"] / trl, 3),
               "grpo_step_vs_trl_sync": round(per_step["ours sync"] / trl, 3)}  # fmt: skip
    for name, runs in sides.items():
        first, last = zip(*(_thirds(r["rewards"]) for r in runs))
        finals = [r["eval_reward"] for r in runs]
        (last_mean, last_se), (final_mean, final_se) = _mean_se(list(last)), _mean_se(finals)
        figures[f"grpo_learn_eval_reward_{_key(name)}"] = round(final_mean, 3)
        figures[f"grpo_learn_reward_last_third_{_key(name)}"] = round(last_mean, 3)
        figures[f"grpo_learn_reward_gain_{_key(name)}"] = round(last_mean - statistics.fmean(first), 3)
        print(f"{name:16s} {per_step[name]:5.2f} s/step; evaluation after the last step {final_mean:.3f} (standard "
              f"error {final_se:.3f}; per seed {' '.join(f'{x:.3f}' for x in finals)}); training reward last third "
              f"{last_mean:.3f} ({last_se:.3f}), first third {statistics.fmean(first):.3f}")  # fmt: skip
        if name.startswith("ours"):  # rows of advantage 0: left out of our computation, computed by TRL's
            figures["grpo_learn_rows_skipped_" + name.split()[1]] = round(
                statistics.fmean(r["rows_skipped"] for r in runs), 3)
    return figures


def main() -> None:
    ap = arguments(steps=30, timeout=1800)
    ap.add_argument("--seeds", type=int, default=3, help="runs of every side, each with its own prompt order and "
                    "sampling seed (the figures are over all of them)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="the TRL side's seed (internal, with --trl)")
    args = ap.parse_args()
    if args.trl:
        print(json.dumps(run_trl(args.model, args.steps, args.work / f"out-trl-{args.seed}", args.seed)))
        return
    import scalarlm

    model = make_model(args.model.resolve())
    work = Path(tempfile.mkdtemp(prefix="bench-grpo-learn-", dir=ROOT / "build" / "bench"))
    print(f"model {model}; {PROMPTS_PER_STEP} prompts x {GROUP} completions x <= {COMPLETION} tokens per step, "
          f"{args.steps} steps, lr {LR}, {args.seeds} seed(s); work {work}")  # fmt: skip
    port = free_port()
    argv = [python(), "-m", "scalarlm.cli", "serve", "--model", str(model), "--home", str(work / "home"),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    sides: dict[str, list[dict]] = {"ours sync": [], "ours async": [], "TRL GRPOTrainer": []}
    with SlowStart(argv, f"http://127.0.0.1:{port}/v1/health", log=work / "scalarlm-serve.log"):
        llm = scalarlm.ScalarLM(api_url=f"http://127.0.0.1:{port}", timeout=600)
        start, checkpoint = warm_start(llm, work / "home")
        warm = ours_eval(llm, start, 0)
        print(f"warm start {start}: {checkpoint}; evaluation {warm:.3f}")
        for seed in range(args.seeds):
            for name, side in (("ours sync", ours_sync), ("ours async", ours_async)):
                before = load()
                run = side(llm, start, args.steps, seed)
                sides[name].append(run)
                print(f"seed {seed} {name:11s} {run['seconds_per_step']:6.2f} s/step   load avg {before} -> {load()}")
                print("   rewards " + " ".join(f"{r:.2f}" for r in run["rewards"]))
            print(f"   async staleness per step: {sides['ours async'][-1].get('staleness')}")
    for seed in range(args.seeds):  # our server stopped: TRL has the box to itself
        before = load()
        trl_proc = subprocess.Popen([python(), "-m", "bench.grpo_learn", "--trl", "--model", str(checkpoint),
                                     "--steps", str(args.steps), "--work", str(work), "--seed", str(seed)], cwd=ROOT,
                                    stdout=open(work / "trl.json", "w"), stderr=open(work / "trl.log", "w"),
                                    start_new_session=True)  # fmt: skip
        run = finish_trl(trl_proc, work, args.timeout)
        sides["TRL GRPOTrainer"].append(run)
        print(f"seed {seed} TRL         {run['seconds_per_step']:6.2f} s/step   load avg {before} -> {load()}")
        print("   rewards " + " ".join(f"{r:.2f}" for r in run["rewards"]))
    figures = {"grpo_learn_eval_reward_warm_start": round(warm, 3), **summarize(sides)}
    print(f"grpo_step_vs_trl = {figures['grpo_step_vs_trl']} (async, target <= 0.5), "
          f"grpo_step_vs_trl_sync = {figures['grpo_step_vs_trl_sync']}")
    plot(sides, args.steps, warm)
    print(f"wrote {PNG}")
    merge_results(figures)
    print(json.dumps(figures))
    drop_weights(work)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    main()
