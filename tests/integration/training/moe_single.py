"""Shared by the MoE check scripts: a megatron model loaded from an HF directory (at TP=1, or this rank's shard), and
the main that runs a one-process check on each directory named on the command line, and the hook on transformers'
routers."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path


def hf_sparse_block(layer):
    """A transformers decoder layer's sparse block: `mlp` in transformers 5 (Mixtral too), Granite MoE's
    `block_sparse_moe`."""
    return layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe


def hook_hf_router(layer, record: Callable[[dict], None]):
    """Call `record` with the router's `logits`, the chosen experts' `weights` and their `index` on each forward of
    the layer's HF router: `gate` and GPT-OSS's `router` return them in that order, Granite MoE's `router` as (index,
    weights, logits) (its first output is the integer one)."""
    block = hf_sparse_block(layer)
    router = block.gate if hasattr(block, "gate") else block.router

    def hook(module, args, out) -> None:
        logits, weights, index = out if out[0].is_floating_point() else out[::-1]
        record({"logits": logits, "weights": weights, "index": index})

    return router.register_forward_hook(hook)


def load_into(model, model_dir: Path, arch, par=None) -> int:
    """Copy this TP rank's (and, for an `expert_rank` arch, this EP rank's) HF weights into the megatron `model` and
    tag its TP shards; every parameter must be loaded. Returns how many bytes of the checkpoint it read."""
    import torch

    from scalarlm.training.convert import mark_tensor_parallel
    from scalarlm.training.shard_load import load_rank_params

    params = dict(model.named_parameters())
    loaded, read = load_rank_params(model_dir, arch, par.tp_rank if par else 0, par.tp_size if par else 1)
    assert set(loaded) == set(params), sorted(set(loaded) ^ set(params))[:4]
    with torch.no_grad():
        for name, value in loaded.items():
            params[name].copy_(value)
    mark_tensor_parallel(model, arch)
    return read


def loaded_model(model_dir: Path, arch, aux_loss_coef: float = 0.0):
    """The TP=1 megatron model of `arch`, HF weights loaded, in training mode."""
    from scalarlm.training.model import build_gpt_model

    model = build_gpt_model(arch, 1, bf16=False, aux_loss_coef=aux_loss_coef)
    load_into(model, model_dir, arch)
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
