"""Run by test_moe_parity.py as one plain process (TP=1) or under `mpirun -n 2` (TP=2, sequence parallel):
`moe_sp_check.py TP OUT_DIR MODEL...`.

For each mixture-of-experts HF model directory, in training mode with the load-balancing loss on (coefficient COEF,
weighted as the step driver weighs it): for each length in LENGTHS, one packed micro-batch of two documents goes
through `losses.token_losses` (at TP=2 each rank routes its half of the tokens; an odd length runs padded to an
even one) and its backward, in megatron DDP; after the optimizers' `finish_grad_sync` the grads are gathered under
the HF names; rank 0 saves them, the summed cross-entropy and the `BalanceMeter` metric to
`OUT_DIR/<model>-<length>.pt`, for the test to compare TP=2 with TP=1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from moe_single import load_into

COEF = 0.05
LENGTHS = (40, 41)  # 41: the padded path (and its padding mask) at TP=2


def check(model_dir: Path, par, out: Path) -> None:
    from scalarlm.training.convert import mcore_to_hf
    from scalarlm.training.data import MicroBatch
    from scalarlm.training.export import gather_tp_shards
    from scalarlm.training.losses import token_losses
    from scalarlm.training.model import build_gpt_model, model_arch, sequence_parallel
    from scalarlm.training.moe_balance import BalanceMeter, aux_loss_scale
    from scalarlm.training.optim import finish_grad_sync, wrap_data_parallel

    arch = model_arch(model_dir)
    for length in LENGTHS:
        model = build_gpt_model(arch, par.tp_size, bf16=False, aux_loss_coef=COEF,
                                sequence_parallel=sequence_parallel(arch, par.tp_size))  # fmt: skip
        assert model.config.sequence_parallel == (par.tp_size > 1)
        load_into(model, model_dir, arch, par)
        model.train()
        ids = torch.randint(0, arch.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        cut = length // 2 + 3
        positions = torch.cat([torch.arange(cut), torch.arange(length - cut)])[None]
        micro = MicroBatch(ids, torch.roll(ids, -1, dims=1), torch.ones(1, length), positions, None, (0, cut, length))
        meter = BalanceMeter(model)
        ddp = wrap_data_parallel(model, par)
        aux_loss_scale(length)
        with meter.forward_pass():
            ce = token_losses(ddp, micro)
        assert ce.shape == (1, length), ce.shape
        (ce.sum() / length).backward()
        finish_grad_sync(ddp, par.tp_size)  # the optimizers' own: DP sync, then the TP sums of the norms' and routers' grads
        metric, tokens = meter.take().tolist()
        for p in model.parameters():  # (a sigmoid router's fixed expert bias has no grad: zeros)
            p.data = p.main_grad.clone() if p.requires_grad else torch.zeros_like(p)
        shards = gather_tp_shards(model, arch, par)
        if par.is_main:
            torch.save({"grads": mcore_to_hf(shards, arch), "ce": float(ce.sum()), "metric": metric / tokens,
                        "tokens": tokens}, out / f"{model_dir.name}-{length}.pt")  # fmt: skip


def main() -> int:
    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.parallel import init_parallel, shutdown_parallel

    tp, out = int(sys.argv[1]), Path(sys.argv[2])
    par = init_parallel(launch_env_from(os.environ), tp, seed=0)
    try:
        for model_dir in map(Path, sys.argv[3:]):
            check(model_dir, par, out)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
