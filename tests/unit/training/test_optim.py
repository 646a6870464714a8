"""The CPU optimizer honours the train args that shape an update: `weight_decay` (matrices only, as HF Trainer) and
`max_grad_norm` (global-norm clipping; the reported grad norm is the one before clipping).

megatron's DDP wrapper is stood in for by a module with the two hooks the optimizer calls and a `main_grad` per
parameter (where DDP accumulates grads); the optimizer itself is the real `CpuAdamW`.
"""

from __future__ import annotations

import math

import pytest
import torch

from scalarlm.protocol.training import TrainArgs
from scalarlm.training.optim import CpuAdamW
from scalarlm.training.parallel import Parallel


class _GradBuffers(torch.nn.Module):
    """A Linear whose grads sit in `main_grad`, as megatron DDP leaves them."""

    def __init__(self, grad: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        for p in self.parameters():
            p.tensor_model_parallel = True  # counted in the global norm (one rank: no duplicates)
            p.main_grad = torch.full_like(p, grad)

    def finish_grad_sync(self) -> None:
        pass

    def zero_grad_buffer(self) -> None:
        pass


def _one_rank() -> Parallel:
    return Parallel(rank=0, world_size=1, device=torch.device("cpu"), tp_size=1, tp_rank=0, dp_size=1, dp_rank=0,
                    tp_group=None, dp_group=None)  # fmt: skip


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_weight_decay_shrinks_matrices_only(weight_decay: float) -> None:
    model = _GradBuffers(grad=0.0)  # no gradient: AdamW's only change is the decay
    weight, bias = model.linear.weight.detach().clone(), model.linear.bias.detach().clone()
    CpuAdamW(model, TrainArgs(weight_decay=weight_decay), _one_rank()).step(lr=0.1)
    assert torch.allclose(model.linear.weight, weight * (1 - 0.1 * weight_decay))
    assert torch.equal(model.linear.bias, bias)


@pytest.mark.parametrize(("max_grad_norm", "clipped"), [(1.0, True), (100.0, False)])
def test_max_grad_norm_clips_the_global_norm(max_grad_norm: float, clipped: bool) -> None:
    model = _GradBuffers(grad=0.5)  # 20 elements of 0.5: global norm sqrt(5)
    norm = CpuAdamW(model, TrainArgs(max_grad_norm=max_grad_norm), _one_rank()).step(lr=1e-3)
    assert norm == pytest.approx(math.sqrt(5))  # reported before clipping
    stepped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    assert stepped == pytest.approx(max_grad_norm if clipped else math.sqrt(5), rel=1e-5)
