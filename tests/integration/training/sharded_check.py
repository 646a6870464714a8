"""Run by test_sharded_checkpoints.py as one process (TP=1) or under `mpirun -n 2` (TP=2), on sharded bf16/fp16
checkpoints: the parity checks of convert_check.py (HF logits vs megatron), plus, per rank, what the trainer's
loader (`shard_load.load_rank_params`) read and whether its parameters equal converting the whole checkpoint.
Prints one `RESULT {json}` line per model on rank 0."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # a script, not a test module: find convert_check next to it

from convert_check import check  # noqa: E402
from sharded_models import model_arch  # noqa: E402


def rank_load(model_dir: Path, par) -> dict:
    """This rank's sliced read: bytes read and stored, and equality with the full conversion."""
    from scalarlm.training import hf_io
    from scalarlm.training.convert import hf_to_mcore
    from scalarlm.training.shard_load import load_rank_params

    arch = model_arch(model_dir)
    params, stats = load_rank_params(model_dir, arch, par.tp_rank, par.tp_size)
    full = hf_to_mcore(hf_io.load_weights(model_dir), arch, par.tp_rank, par.tp_size)
    exact = set(params) == set(full) and all(torch.equal(params[k], full[k]) for k in full)
    return {**stats, "rank": par.tp_rank, "exact": exact}


def main() -> int:
    import torch.distributed as dist

    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.parallel import init_parallel, shutdown_parallel

    tp = int(sys.argv[1])
    par = init_parallel(launch_env_from(os.environ), tp, seed=0)
    try:
        for model_dir in map(Path, sys.argv[2:]):
            result = check(model_dir, par)
            loads: list = [None] * par.tp_size
            dist.all_gather_object(loads, rank_load(model_dir, par), group=par.tp_group)
            if par.is_main:
                print("RESULT " + json.dumps({**result, "loads": loads}), flush=True)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
