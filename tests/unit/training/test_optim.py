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


def test_set_adam_sets_the_decay_of_matrices_and_the_clipping_norm() -> None:
    """Tinker's optim_step sets Adam's parameters per call (`set_adam`): decay on the matrices only, inf = no clip."""
    model = _GradBuffers(grad=0.0)
    weight, bias = model.linear.weight.detach().clone(), model.linear.bias.detach().clone()
    opt = CpuAdamW(model, TrainArgs(weight_decay=0.0, max_grad_norm=1.0), _one_rank())
    opt.set_adam(betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5, max_norm=math.inf)
    assert [(g["betas"], g["eps"]) for g in opt.opt.param_groups] == [((0.8, 0.9), 1e-6)] * 2
    opt.step(lr=0.1)
    assert torch.allclose(model.linear.weight, weight * (1 - 0.1 * 0.5)) and torch.equal(model.linear.bias, bias)
    big = _GradBuffers(grad=0.5)  # global norm sqrt(5): not clipped with max_norm inf
    opt = CpuAdamW(big, TrainArgs(max_grad_norm=1.0), _one_rank())
    opt.set_adam(betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, max_norm=math.inf)
    opt.step(lr=1e-3)
    assert math.sqrt(sum(float(p.grad.pow(2).sum()) for p in big.parameters())) == pytest.approx(math.sqrt(5))


def test_the_gpu_optimizer_decays_matrices_only_on_megatrons_param_groups() -> None:
    """megatron builds its param groups with `wd_mult` 0 for norms and biases but the config's weight decay on every
    group (only its own LR scheduler, which we do not run, applies the multiplier): `set_groups` applies it. Checked
    on megatron's real grouping of a module with a matrix, a bias and a norm, stepped by torch AdamW with no
    gradient (megatron's optimizer itself needs CUDA)."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    from scalarlm.training.optim import set_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    before = [p.detach().clone() for p in model.parameters()]  # weight, bias, norm weight, norm bias
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        groups = _get_param_groups([model], OptimizerConfig(lr=0.1, weight_decay=0.5), None)
    finally:
        dist.destroy_process_group()
    opt = torch.optim.AdamW(groups, lr=0.1, weight_decay=0.5)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.5, 0.5]  # megatron's groups as built
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    set_groups(opt.param_groups, lr=0.1, weight_decay=0.5)
    opt.step()
    after = list(model.parameters())
    assert torch.allclose(after[0], before[0] * (1 - 0.1 * 0.5))
    assert all(torch.equal(a, b) for a, b in zip(after[1:], before[1:]))
