"""Shared by the one-process MoE check scripts (moe_aux_check.py, moe_replay_check.py): a megatron model loaded from
an HF directory, and the main that runs a check on each directory named on the command line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path


def loaded_model(model_dir: Path, arch, aux_loss_coef: float = 0.0):
    """The TP=1 megatron model of `arch`, HF weights loaded, in training mode."""
    import torch

    from scalarlm.training.convert import mark_tensor_parallel
    from scalarlm.training.model import build_gpt_model
    from scalarlm.training.shard_load import load_rank_params

    model = build_gpt_model(arch, 1, bf16=False, aux_loss_coef=aux_loss_coef)
    params = dict(model.named_parameters())
    loaded, _ = load_rank_params(model_dir, arch, 0, 1)
    with torch.no_grad():
        for name, value in loaded.items():
            params[name].copy_(value)
    mark_tensor_parallel(model, arch)
    return model.train()


def run_each(check: Callable[[Path], dict]) -> int:
    """One process, one rank: print `RESULT <json>` of `check` for each model directory in argv."""
    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.parallel import init_parallel, shutdown_parallel

    init_parallel(launch_env_from(os.environ), 1, seed=0)
    try:
        for model_dir in map(Path, sys.argv[1:]):
            print("RESULT " + json.dumps(check(model_dir)), flush=True)
    finally:
        shutdown_parallel()
    return 0
