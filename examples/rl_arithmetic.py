"""Reinforcement learning from a client loop: teach the tiny model single-digit addition with GRPO.

    .venv/bin/python examples/rl_arithmetic.py                 # starts its own server (temp home, tiny model)
    .venv/bin/python examples/rl_arithmetic.py --api-url URL   # or uses a running one
    .venv/bin/python examples/rl_arithmetic.py --short         # a few steps (the end of `make demo`)
    .venv/bin/python examples/rl_arithmetic.py --async         # generate batch k+1 while step k trains

1. SFT warm-start: a short full-weight training job teaches the answer format ("3+4=" -> "7").
2. An RL session starts from that job's weights (one optimizer step per batch, weights published after
   every step and served at once). Each step: generate `--group-size` completions per prompt with
   temperature and sampling logprobs, score them here on the client with an exact-answer reward, send the
   scored rows to `session.step(rows)`, which returns the new weights version; the next batch is generated
   with it (every result says which version produced it).
   With `--async`, `session.pipeline(...)` overlaps the two: it generates the next batch while the previous
   step trains (so that batch comes from weights one version older: the session's `max_staleness` 1), and
   stamps each batch with the version that generated it; the trainer weighs it by its importance ratio
   against the sampling logprobs.
3. Mean reward (0-100) is measured before and after with the same sampling; the last line printed is
   `reward_gain=<final - initial>`.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import scalarlm
from scalarlm.rewards import exact_match

PROBLEMS = [(f"{a}+{b}=", str(a + b)) for a, b in itertools.product(range(5), repeat=2)]  # answers 0..8: one token
SFT_ARGS = {"adapter_type": "full", "learning_rate": 3e-3, "max_seq_len": 32, "dtype": "float32",
            "lr_schedule": "constant", "batch_size": 8}  # fmt: skip
RL_ARGS = {"adapter_type": "full", "loss": "grpo", "learning_rate": 1e-3, "max_seq_len": 32, "dtype": "float32",
           "lr_schedule": "constant", "clip_eps": 0.2}  # fmt: skip


def sample(llm: scalarlm.ScalarLM, model: str, prompts: list[str], group: int, temperature: float,
           seed: int) -> list[Any]:  # fmt: skip
    """`group` sampled completions (with their logprobs) per prompt, as full results."""
    return llm.generate(prompts, model_name=model, max_tokens=3, n=group, temperature=temperature, logprobs=1,
                        seed=seed, return_details=True)  # fmt: skip


def mean_reward(llm: scalarlm.ScalarLM, model: str, group: int, temperature: float, seed: int) -> float:
    """Mean exact-answer reward (0-100) over every problem, `group` samples each."""
    results = sample(llm, model, [p for p, _ in PROBLEMS], group, temperature, seed)
    scores = [exact_match(o.text, answer) for (_, answer), r in zip(PROBLEMS, results) for o in r.outputs or []]
    return 100.0 * statistics.fmean(scores) if scores else 0.0


def warm_start(llm: scalarlm.ScalarLM, steps: int) -> str:
    """Supervised warm-start on the answer format; returns the job id (a servable full-weight model)."""
    rows = [{"input": p, "output": a} for p, a in PROBLEMS]
    args = {**SFT_ARGS, "max_steps": steps, "steps_per_checkpoint": steps}
    start = time.monotonic()
    job = llm.train(rows, train_args=args)
    status = job.wait(timeout=900, progress=False)
    print(f"SFT warm-start {job.id}: {status.status} in {time.monotonic() - start:.1f} s, loss {status.loss}")
    return job.id


def grpo(llm: scalarlm.ScalarLM, start_model: str, args: argparse.Namespace) -> str:
    """The RL loop: sample, score on the client, one session step per batch; returns the trained model name."""
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.max_seconds
    train_args = {**RL_ARGS, "learning_rate": args.lr}
    with llm.rl_session(model_name=start_model, train_args=train_args) as session:
        print(f"RL session {session.id} started from {start_model}")
        model, version = start_model, 0
        for step in range(1, args.steps + 1):
            batch = rng.sample(PROBLEMS, min(args.prompts_per_step, len(PROBLEMS)))
            t0 = time.monotonic()
            results = sample(llm, model, [p for p, _ in batch], args.group_size, args.temperature, rng.randrange(1 << 30))
            gen_seconds = time.monotonic() - t0
            rows, rewards = [], []
            for (prompt, answer), result in zip(batch, results):
                for out in result.outputs or []:
                    reward = exact_match(out.text, answer)
                    rewards.append(reward)
                    rows.append({"prompt": prompt, "completion": out.text, "reward": reward, "group": prompt,
                                 "logprobs": out.logprobs, "completion_token_ids": out.token_ids})  # fmt: skip
            served = sorted({(r.model, r.version) for r in results})
            t1 = time.monotonic()
            version = session.step(rows, version=version)  # the session version that generated the batch
            model = session.model_name
            last = session.last
            print(f"step {step:3d}  reward {100 * statistics.fmean(rewards):5.1f}  generated by {served}  "
                  f"-> version {version}  loss {last.loss if last else None}  "
                  f"(generate {gen_seconds:.2f} s, train+publish {time.monotonic() - t1:.2f} s)")  # fmt: skip
            if time.monotonic() > deadline:
                print(f"time budget of {args.max_seconds:.0f} s reached after {step} steps")
                break
        return model if version else start_model


def grpo_async(llm: scalarlm.ScalarLM, start_model: str, args: argparse.Namespace) -> str:
    """The same loop with generation overlapped: `session.pipeline` generates batch k+1 while step k trains."""
    rng = random.Random(args.seed)
    answers = dict(PROBLEMS)
    deadline = time.monotonic() + args.max_seconds
    train_args = {**RL_ARGS, "learning_rate": args.lr}

    def prompts(step: int) -> list[str]:
        return [p for p, _ in rng.sample(PROBLEMS, min(args.prompts_per_step, len(PROBLEMS)))]

    def score(batch: list[str], results: list[Any]) -> list[dict[str, Any]]:
        return [{"prompt": p, "completion": o.text, "reward": exact_match(o.text, answers[p]), "group": p,
                 "logprobs": o.logprobs, "completion_token_ids": o.token_ids}
                for p, r in zip(batch, results) for o in r.outputs or []]  # fmt: skip

    with llm.rl_session(model_name=start_model, train_args=train_args, max_staleness=1) as session:
        print(f"RL session {session.id} started from {start_model} (async, max_staleness {session.max_staleness})")
        start, version = time.monotonic(), 0
        steps = session.pipeline(prompts, score, args.steps, max_tokens=3, n=args.group_size,
                                 temperature=args.temperature, logprobs=1)  # fmt: skip
        for s in steps:
            version = s.version
            reward = 100 * statistics.fmean(r["reward"] for r in s.rows)
            print(f"step {s.index + 1:3d}  reward {reward:5.1f}  generated by version {s.generated_version}  "
                  f"-> version {version}  staleness {s.response.staleness}  loss {s.response.loss}  "
                  f"(generate {s.generate_seconds:.2f} s, {time.monotonic() - start:.1f} s so far)")  # fmt: skip
            if time.monotonic() > deadline:
                print(f"time budget of {args.max_seconds:.0f} s reached after {s.index + 1} steps")
                break
        return session.model_name if version else start_model


def run(url: str, args: argparse.Namespace) -> float:
    """Warm-start, measure, GRPO, measure; returns the reward gain in points."""
    llm = scalarlm.ScalarLM(api_url=url, timeout=300)
    start_model = warm_start(llm, args.sft_steps)
    initial = mean_reward(llm, start_model, args.eval_group, args.temperature, seed=1)
    print(f"initial mean reward {initial:.1f} (model {start_model}, {args.eval_group} samples per problem)")
    trained = (grpo_async if args.overlap else grpo)(llm, start_model, args)
    final = mean_reward(llm, trained, args.eval_group, args.temperature, seed=2)
    print(f"final mean reward {final:.1f} (model {trained})")
    return final - initial


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api-url", help="use this server instead of starting one")
    parser.add_argument("--model", type=Path, default=Path("models/tiny"), help="base model for the own server")
    parser.add_argument("--short", action="store_true", help="a few steps only (make demo)")
    parser.add_argument("--async", dest="overlap", action="store_true",
                        help="generate the next batch while the previous step trains (max_staleness 1)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-seconds", type=float, default=420.0, help="stop the RL loop after this long")
    parser.add_argument("--sft-steps", type=int, default=8, help="few on purpose: leave room for RL to improve")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=25)
    parser.add_argument("--eval-group", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=RL_ARGS["learning_rate"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.short:
        args.steps, args.eval_group = 3, 4

    started = time.monotonic()
    with ExitStack() as stack:
        url = args.api_url or stack.enter_context(own_server(args.model))
        gain = run(url.rstrip("/"), args)
    print(f"total {time.monotonic() - started:.0f} s")
    print(f"reward_gain={gain:.1f}")
    return 0


def own_server(model: Path):  # type: ignore[no-untyped-def]
    """`scalarlm serve` on a free port with a temporary home, stopped on exit; yields its URL."""
    from contextlib import contextmanager

    from demo import free_port, start_server, stop_server, wait_until_up  # examples/demo.py, next to this file

    @contextmanager
    def serving():  # type: ignore[no-untyped-def]
        if not (model / "config.json").exists():
            from scalarlm.cli.tiny_model import make_tiny_model

            print(f"building a tiny random-weight model in {model}")
            make_tiny_model(model)
        with tempfile.TemporaryDirectory(prefix="scalarlm-rl-") as tmp:
            port, log_path = free_port(), Path(tmp) / "server.log"
            url = f"http://127.0.0.1:{port}"
            server = start_server(model.resolve(), Path(tmp) / "home", port, log_path)
            try:
                print(f"server up in {wait_until_up(url, server, log_path):.1f} s at {url} (log: {log_path})")
                yield url
            finally:
                stop_server(server)

    return serving()


if __name__ == "__main__":
    sys.exit(main())
