"""Tinker `forward_backward` on a GRPO-shaped batch: ours (datums packed, the samples of one prompt sharing it)
against the same datums one per forward pass (what a trainer without packing does; ours did until this bench).

Both sides run in this process on the same megatron model (bench/training.py's ~39M-parameter Llama, fp32, one rank),
the same datums (PROMPTS prompts x GROUP samples of COMPLETION tokens, ppo loss with per-token advantages and
sampling logprobs, 0 on the prompt as the Tinker cookbook sends them) and the same threads, alternated REPEATS times
after a warm-up; each side's time is its median. Both compute the same logprobs, losses and gradients
(tests/integration/training/test_grpo_padding_free.py). Prints `tinker_fb_vs_one_datum_p<prompt tokens>` for a short
and a long prompt and the load average, and merges them into build/bench/results.json. Not a test.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common import ROOT, merge_results
from bench.training import load, make_model

PROMPTS, GROUP, COMPLETION, REPEATS = 4, 8, 16, 5
PROMPT_LENGTHS = (16, 128)


def load_model(model_dir: Path):
    from scalarlm.training import hf_io
    from scalarlm.training.convert import hf_to_mcore
    from scalarlm.training.model import build_gpt_model, model_arch

    arch = model_arch(model_dir)
    model = build_gpt_model(arch, 1, bf16=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in hf_to_mcore(hf_io.load_weights(model_dir), arch, 0, 1).items():
            params[name].copy_(value)
    model.train()
    model.no_sync = contextlib.nullcontext  # what forward_backward calls on the DDP wrapper (one rank: no sync)
    return model, arch


def datums(prompt_len: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(PROMPTS):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(GROUP):
            ids = prompt + [rng.randrange(3, vocab) for _ in range(COMPLETION)]
            n, p = len(ids) - 1, prompt_len - 1
            out.append({"tokens": ids[:-1], "loss_fn_inputs": {
                "target_tokens": ids[1:], "advantages": [0.0] * p + [rng.uniform(-1, 1)] * (n - p),
                "logprobs": [0.0] * p + [rng.uniform(-3, -1) for _ in range(n - p)]}})  # fmt: skip
    return out


def one_datum_at_a_time(model, data: list[dict]) -> None:
    """The baseline: one forward and one backward per datum."""
    from scalarlm.training.data import MicroBatch
    from scalarlm.training.losses import token_losses
    from scalarlm.training.tinker_ops import _loss, loss_inputs

    for i, d in enumerate(data):
        n = len(d["tokens"])
        row = lambda xs: torch.tensor(xs, dtype=torch.long).unsqueeze(0)  # noqa: E731
        batch = MicroBatch(row(d["tokens"]), row(d["loss_fn_inputs"]["target_tokens"]), torch.ones(1, n),
                           row(list(range(n))), None, (0, n))  # fmt: skip
        logp = -token_losses(model, batch).float()[0]
        _loss("ppo", logp, loss_inputs("ppo", d, n, i, {}), {}).sum().backward()


def main() -> None:
    from scalarlm.protocol.training import TrainArgs
    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.parallel import init_parallel, shutdown_parallel
    from scalarlm.training.tinker_ops import forward_backward

    model_dir = make_model((ROOT / "build" / "bench" / "model-40m").resolve())
    init_parallel(launch_env_from(os.environ), 1, seed=0)
    try:
        model, arch = load_model(model_dir)
        trainer = SimpleNamespace(ddp=model, par=SimpleNamespace(device=torch.device("cpu"), dp_rank=0, dp_size=1),
                                  arch=arch, max_len=512,
                                  args=TrainArgs())  # fmt: skip
        figures = {}
        for prompt_len in PROMPT_LENGTHS:
            data = datums(prompt_len, arch.vocab_size)
            sides = {"ours": lambda: forward_backward(trainer, {"loss_fn": "ppo", "data": data}, backward=True),
                     "one": lambda: one_datum_at_a_time(model, data)}  # fmt: skip
            times: dict[str, list[float]] = {name: [] for name in sides}
            before = load()
            for rep in range(REPEATS + 1):
                for name, run in sides.items():
                    start = time.perf_counter()
                    run()
                    if rep:  # the first round warms up
                        times[name].append(time.perf_counter() - start)
                    model.zero_grad(set_to_none=True)
            ours, one = (statistics.median(times[name]) for name in ("ours", "one"))
            key = f"tinker_fb_vs_one_datum_p{prompt_len}"
            figures[key] = round(ours / one, 3)
            print(f"{PROMPTS} prompts of {prompt_len} tokens x {GROUP} datums x {COMPLETION} completion tokens, ppo: "
                  f"ours {ours:.3f} s, one datum per forward {one:.3f} s: {key} = {figures[key]}   "
                  f"load avg {before} -> {load()}")  # fmt: skip
        merge_results(figures)
        print(figures)
    finally:
        shutdown_parallel()


if __name__ == "__main__":
    main()
