"""The tinker-cookbook's own recipes, unchanged, against `scalarlm serve`: only the base URL, the key (the SDK's
TINKER_API_KEY), the model (our tiny model's directory) and a renderer are passed, as command-line settings.

- `recipes.chat_sl.train` (the cookbook's supervised recipe) on a JSONL file of conversations in the cookbook's own
  format (the first 8 of its bundled `example_data/conversations.jsonl`, one batch, several epochs): the recipe's own
  `train_mean_nll` falls, and its final sampler answers through the SDK.
- `recipes.math_rl.train` with its default `env=arithmetic` (the cookbook's GRPO-style loop with importance
  sampling): each step's metrics are written, a sampler is published per step, and the final checkpoints are ours.

The cookbook is installed once into build/ with pip (--no-deps: the packages it needs beyond ours are small; its
transformers pin is older than ours and is not what its recipes use). Its other recipes load hub datasets or pick
their renderer from a hub model name, which this offline box cannot do (docs/tinker.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import KEY

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
COOKBOOK = REPO / "build" / "tinker-cookbook-0.5.8"
# tinker-cookbook 0.5.8 is the newest whose requirements this index can meet (0.6.1 needs tml-renderers>=0.4.1).
PACKAGES = ["tinker-cookbook==0.5.8", "chz==0.4.0", "tml-renderers==0.2.1", "blobfile==3.3.0", "pyrage==1.4.0",
            "termcolor==3.3.0", "lxml==6.1.3", "pycryptodomex==3.24.2",
            # the math_rl recipe's grader (the cookbook's `math-rl` extra)
            "pylatexenc==2.11", "math-verify==0.9.0", "latex2sympy2_extended==1.11.0",
            "antlr4-python3-runtime==4.13.2"]  # fmt: skip


@pytest.fixture(scope="module")
def cookbook() -> Path:
    marker = COOKBOOK / ".complete"
    if not marker.exists():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(COOKBOOK),
                               *PACKAGES], capture_output=True, text=True, timeout=600)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot install tinker-cookbook from PyPI: {done.stderr[-500:]}")
        marker.touch()
    return COOKBOOK


def _recipe(module: str, settings: dict[str, Any], url: str, cookbook: Path, cwd: Path) -> Path:
    """Run `python -m tinker_cookbook.<module> key=value ...`; returns its log_path (the recipe's metrics)."""
    log_path = cwd / module.rsplit(".", 2)[-2]
    args = {"base_url": url, "log_path": str(log_path), "behavior_if_log_dir_exists": "delete", **settings}
    env = {**os.environ, "PYTHONPATH": str(cookbook), "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", f"tinker_cookbook.{module}", *(f"{k}={v}" for k, v in args.items())],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "Training completed successfully" in done.stdout + done.stderr
    return log_path


def _metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def _final(log_path: Path) -> dict[str, Any]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()][-1]


def test_chat_sl_recipe_learns_and_its_sampler_answers(server: tuple[str, Path], service: Any, cookbook: Path,
                                                       tiny_model_dir: Path, tmp_path: Path) -> None:  # fmt: skip
    data = tmp_path / "conversations.jsonl"
    bundled = cookbook / "tinker_cookbook" / "example_data" / "conversations.jsonl"
    data.write_text("".join(bundled.read_text().splitlines(keepends=True)[:8]))
    log_path = _recipe("recipes.chat_sl.train", {
        "model_name": tiny_model_dir, "renderer_name": "role_colon", "dataset": data, "batch_size": 8,
        "max_length": 256, "learning_rate": 5e-3, "lora_rank": 8, "num_epochs": 6, "eval_every": 0,
        "save_every": 0}, server[0], cookbook, tmp_path)  # fmt: skip
    rows = _metrics(log_path)
    assert [row["step"] for row in rows] == list(range(6))
    nll = [row["train_mean_nll"] for row in rows]
    assert nll[-1] < nll[0] - 0.3, nll  # the same batch each epoch: its loss falls
    assert all(row["grad_norm"] > 0 for row in rows)
    final = _final(log_path)
    sampler = service.create_sampling_client(model_path=final["sampler_path"])
    out = sampler.sample(types.ModelInput.from_ints([1, 5, 9, 13]), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, stop=[])).result()  # fmt: skip
    assert [len(s.tokens) for s in out.sequences] == [4, 4]
    run_id = final["state_path"].removeprefix("tinker://").split("/")[0]
    listed = tinker.RestClient(base_url=server[0], api_key=KEY).list_checkpoints(run_id).result().checkpoints
    assert {c.tinker_path for c in listed} >= {final["state_path"], final["sampler_path"]}


def test_math_rl_recipe_runs_its_arithmetic_loop(server: tuple[str, Path], cookbook: Path, tiny_model_dir: Path,
                                                tmp_path: Path) -> None:  # fmt: skip
    log_path = _recipe("recipes.math_rl.train", {
        "model_name": tiny_model_dir, "renderer_name": "role_colon", "env": "arithmetic", "groups_per_batch": 2,
        "group_size": 4, "max_tokens": 5, "max_steps": 3, "lora_rank": 8, "eval_every": 0, "save_every": 0},
        server[0], cookbook, tmp_path)  # fmt: skip
    rows = _metrics(log_path)
    assert [row["progress/batch"] for row in rows] == [0, 1, 2]
    assert all(row["env/all/total_episodes"] == 8 and row["env/all/total_ac_tokens"] > 0 for row in rows)
    final = _final(log_path)
    run_id = final["state_path"].removeprefix("tinker://").split("/")[0]
    # a sampler before each step (save_weights_and_get_sampling_client: versions 0, 1, 2) and the final one (3),
    # each a published version of the run
    published = {p.name for p in (server[1] / "jobs" / run_id / "checkpoints").glob("step-*")}
    assert published == {"step-0", "step-1", "step-2", "step-3"}
