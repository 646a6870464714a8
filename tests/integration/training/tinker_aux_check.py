"""Run by test_moe_parity.py (one process): `tinker_aux_check.py JOB_DIR` for an RL session on a MoE model with a
trained load-balancing loss. Runs Tinker's forward_backward on two datums, then one ordinary GRPO session step (at a
learning rate of 1e-12: the weights stay put), then the same forward_backward again, and prints `RESULT {"router_grad",
"max_diff"}`: the routers' gradient norm and the largest difference between the two calls' router gradients. A GRPO
step sets megatron's aux-loss backward scale (1 / its tokens); forward_backward must not inherit it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    import torch

    from scalarlm.checkpoint import JobDir
    from scalarlm.training import tinker_ops
    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.loop import Trainer
    from scalarlm.training.parallel import init_parallel, shutdown_parallel
    from scalarlm.training.session_loop import session_step

    job = JobDir(Path(sys.argv[1]))
    par = init_parallel(launch_env_from(os.environ), 1, 0)
    try:
        trainer = Trainer(job, job.read_config(), par, [])
        tokens = [5, 9, 11, 20, 31, 7, 8, 40]
        datum = {"tokens": tokens, "loss_fn_inputs": {"target_tokens": [*tokens[1:], 3]}}
        data = [datum, {**datum, "tokens": [6, *tokens[1:]]}]
        request = {"op": "forward_backward", "loss_fn": "cross_entropy", "data": data}

        def router_grad() -> torch.Tensor:
            tinker_ops.forward_backward(trainer, request, True)
            grads = [getattr(p, "main_grad", p.grad).clone().reshape(-1) for n, p in trainer.model.named_parameters()
                     if "router" in n]  # fmt: skip
            trainer.optimizer.zero_grad()
            return torch.cat(grads)

        before = router_grad()
        rows = [{"prompt": p, "completion": c, "reward": r}
                for p in ("2+2=", "3+3=") for c, r in ((" 4", 1.0), (" no", 0.0))]  # fmt: skip
        session_step(trainer, rows)
        trainer.optimizer.zero_grad()
        after = router_grad()
        result = {"router_grad": float(before.norm()), "max_diff": float((before - after).abs().max())}
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
