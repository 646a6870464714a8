"""Run by test_sft_jobs.py (one process): megatron's activation recompute (`gradient_checkpointing`) on a real model.

Builds the model twice from the same HF checkpoint, with and without recompute, runs one forward + backward on a
fixed batch and prints one JSON line: the loss and max gradient differences, and the bytes each forward saved for
backward (counted with autograd's saved-tensor hooks: what activation memory is).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def forward_backward(model_dir: Path, recompute: bool) -> tuple[float, dict[str, torch.Tensor], int]:
    from scalarlm.training import hf_io
    from scalarlm.training.convert import hf_to_mcore
    from scalarlm.training.model import build_gpt_model, model_arch

    arch = model_arch(model_dir)
    model = build_gpt_model(arch, 1, bf16=False, recompute=recompute)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in hf_to_mcore(hf_io.load_weights(model_dir), arch, 0, 1).items():
            params[name].copy_(value)
    model.train()
    # the same dropout masks in both runs (Seed-OSS trains with dropout): the recomputed forward must draw them again
    from megatron.core import tensor_parallel

    torch.manual_seed(0)  # first: on CPU the TP tracker's generator starts as a copy of the default one
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(64, 64, dtype=torch.bool).triu(1)[None, None]
    saved = [0]

    def count(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        loss = model(ids, torch.arange(64).expand(2, 64), mask, labels=ids).sum()
    loss.backward()
    # frozen parameters (a router's fixed expert bias) have no gradient
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, saved[0]


def main() -> int:
    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.parallel import init_parallel, shutdown_parallel

    init_parallel(launch_env_from(os.environ), 1, seed=0)
    try:
        plain, recomputed = (forward_backward(Path(sys.argv[1]), flag) for flag in (False, True))
        grad_diff = max((plain[1][n] - recomputed[1][n]).abs().max().item() for n in plain[1])
        print("RESULT " + json.dumps({"loss_diff": abs(plain[0] - recomputed[0]), "grad_diff": grad_diff,
                                      "saved_plain": plain[2], "saved_recompute": recomputed[2]}), flush=True)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
