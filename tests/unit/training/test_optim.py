"""The CPU optimizer honours the train args that shape an update: `weight_decay` (matrices only, as HF Trainer) and
`max_grad_norm` (global-norm clipping; the reported grad norm is the one before clipping).

megatron's DDP wrapper is stood in for by a module with the two hooks the optimizer calls and a `main_grad` per
parameter (where DDP accumulates grads); the optimizer itself is the real `CpuAdamW`.
"""

from __future__ import annotations

import math
from typing import Any

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


def _megatron_shard(sizes: list[int], seed: int = 0) -> Any:
    """megatron's DistributedOptimizer as one DP rank holding whole fp32 params in one bucket, with torch AdamW (our
    images have no TransformerEngine / Apex): built field by field, since its constructor needs CUDA; its state
    methods (state_dict, load_state_dict, get_parameter_state_dp_reshardable, load_parameter_state_from_dp_reshardable)
    are megatron's own. Each model param's main param is itself (fp32 params: megatron's view of the param)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in sizes]
    shard = DistributedOptimizer.__new__(DistributedOptimizer)
    group = {"params": params, "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    shard.optimizer = torch.optim.AdamW([group], lr=0.1, weight_decay=0.0, foreach=True)
    shard.config = OptimizerConfig(lr=0.1, use_distributed_optimizer=True)
    shard.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    shard.grad_scaler = None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    shard.gbuf_ranges = [{(torch.float32, torch.float32): [{"param_map": {
        p: {"gbuf_local": Range(a, a + p.numel()), "gbuf_world": Range(a, a + p.numel()), "param": Range(0, p.numel())}
        for p, a in zip(params, starts)}}]}]  # fmt: skip
    shard.model_param_group_index_map = {p: (0, i) for i, p in enumerate(params)}
    shard.per_bucket_numel = shard.per_bucket_numel_unpadded = {0: {(torch.float32, torch.float32): [sum(sizes)]}}
    return shard


def _adam_steps(optimizer: Any, shard: Any, steps: range) -> None:
    for k in steps:  # the same gradients on every run: a function of the step and the param
        for i, p in enumerate(shard.optimizer.param_groups[0]["params"]):
            p.grad = torch.full_like(p, 0.1 * (k + 1)) * torch.linspace(-1, 1, p.numel()) * (i + 1)
        shard.optimizer.step()


@pytest.mark.parametrize("chained", [False, True])
def test_the_gpu_optimizer_resumes_exactly(chained: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU optimizer's saved state resumes the uninterrupted run: 2 steps, save, load into a fresh optimizer, 2
    more steps equal 4 steps in a row (params, moments, each param's own step count of 4). Also a save before any
    step (a job cancelled during its model load) is a fresh optimizer's. Each failed on megatron 0.16 as called
    before: its state_dict asserted on no states, its loader wanted a `padding` key its saver never wrote, and its
    load left one shared step tensor that AdamW advanced once per param."""
    import io

    from megatron.core.optimizer import ChainedOptimizer

    from scalarlm.training.optim import GpuDistributedOptimizer

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where megatron allocates a fresh state

    def wrapped(seed: int) -> GpuDistributedOptimizer:
        opt = GpuDistributedOptimizer.__new__(GpuDistributedOptimizer)
        parts = [_megatron_shard([3, 5], seed)] + ([_megatron_shard([4], seed + 1)] if chained else [])
        opt.opt = ChainedOptimizer(parts) if chained else parts[0]
        return opt

    def shards(opt: GpuDistributedOptimizer) -> list[Any]:
        return opt._sub_optimizers()

    def round_trip(state: dict) -> dict:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    straight, resumed = wrapped(0), wrapped(0)
    assert resumed.state_dict() == {"megatron": None, "param_state": None}  # before any step: nothing to keep
    for opt in (straight, resumed):
        for shard in shards(opt):
            _adam_steps(opt, shard, range(2))
    saved = round_trip(resumed.state_dict())
    fresh = wrapped(7)  # other initial params: the saved main params must replace them
    fresh.load_state_dict(saved)
    for opt in (straight, fresh):
        for shard in shards(opt):
            _adam_steps(opt, shard, range(2, 4))
    for a, b in zip(shards(straight), shards(fresh)):
        for p, q in zip(a.optimizer.param_groups[0]["params"], b.optimizer.param_groups[0]["params"]):
            assert torch.allclose(p, q, rtol=0, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(a.optimizer.state[p][key], b.optimizer.state[q][key], rtol=1e-6, atol=0)
        steps = [b.optimizer.state[q]["step"] for q in b.optimizer.param_groups[0]["params"]]
        assert [float(s) for s in steps] == [4.0] * len(steps) and len({id(s) for s in steps}) == len(steps)
