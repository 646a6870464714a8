"""Data-parallel wrapping and the optimizer: torch AdamW on CPU, megatron's distributed optimizer on GPU.

Both paths wrap the model in megatron's DistributedDataParallel. With `calculate_per_token_loss=True` it sums
gradients over DP ranks (no 1/DP scaling), which is what the global-token-normalised SFT loss needs. Gradients
accumulate in DDP's `main_grad` buffers across micro-batches. With DP > 1 the all-reduce runs per bucket, started by
backward as soon as a bucket's grads are final (overlapped with the rest of backward); `finish_grad_sync()` waits.
Reductions of those same grads over another group (LoRA's TP sum) run only after that wait (`step(lr, after_sync)`),
in the same order on every rank: issued earlier, they would race the in-flight DP all-reduce on the same `main_grad`
memory (a LoRA job at DP=2 x TP=2 then left the TP=1 loss curve by ~1e-2 within 4 steps).

* CPU: megatron's optimizer hard-codes CUDA, so `main_grad` is handed to a fused torch AdamW as `.grad`; the grad norm
  is computed over TP shards (replicated params counted once) and clipped like `clip_grad_norm_`.
* GPU: `get_megatron_optimizer` (distributed optimizer, bf16 params with fp32 main params, built-in clipping), with
  the weight decay on matrices only (`set_groups`). This path needs a GPU; the CPU suite tests `set_groups` on
  megatron's own param groups.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from scalarlm.protocol.training import TrainArgs
from scalarlm.training.parallel import Parallel

logger = logging.getLogger(__name__)


class Optimizer(Protocol):
    """What the loop needs from an optimizer."""

    def step(self, lr: float, after_sync: Callable[[], None] | None = None) -> float:
        """Finish the DP grad sync, run `after_sync` (more grad reductions, e.g. LoRA's over TP), clip, update with
        learning rate `lr`; return the pre-clip global grad norm."""

    def zero_grad(self) -> None:
        """Clear gradients before the next step's micro-batches."""

    def set_adam(self, betas: tuple[float, float], eps: float, weight_decay: float, max_norm: float) -> None:
        """Adam's betas and eps, the weight decay (of the matrices) and the clipping norm (inf: none) from the next
        step on (Tinker's `optim_step` sets them per call)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# Gradient all-reduce bucket (elements). With DP > 1 each bucket's all-reduce starts as soon as backward has
# produced its grads, so gloo sums the late layers while the early ones are still in backward.
GRAD_BUCKET_ELEMENTS = 4_000_000


def wrap_data_parallel(model: torch.nn.Module, par: Parallel, overlap: bool = False) -> torch.nn.Module:
    """Wrap `model` in megatron DDP over this rank's DP group (grads summed, accumulated in fp32).

    `overlap` (used with DP > 1 only): each step's last backward starts the bucket all-reduces. Megatron learns in
    the first step how many grads each param gets before its bucket is ready, so every step must run the same
    backwards with sync on: the caller runs all but its last micro-batch under `no_sync()`.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    overlap = overlap and par.dp_size > 1
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        bucket_size=GRAD_BUCKET_ELEMENTS if overlap else None,
        use_distributed_optimizer=par.on_gpu,
        average_in_collective=False,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def finish_grad_sync(ddp_model: torch.nn.Module, tp_size: int) -> None:
    """Wait for every DP bucket's all-reduce; at TP > 1 then sum over TP the grads of the params every TP rank holds
    whole but each computes from its own part: q/k norms (each rank normalises its own heads) and, under sequence
    parallelism, the norms and MoE routers (each rank sees its own tokens). That is megatron's
    `finalize_model_grads`, as its training loop runs it (at TP = 1 its other steps are for pipeline parallelism and
    router expert bias, which we do not run). Without it a full Qwen3 job at TP=2 left the TP=1 curve (grad norm
    15.428 vs 15.433 at step 1)."""
    if tp_size == 1:
        ddp_model.finish_grad_sync()
        return
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp_model])


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not norms or biases), as HF Trainer does."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class CpuAdamW:
    """torch AdamW over megatron DDP's fp32 main grads, with TP-aware global-norm clipping."""

    def __init__(self, ddp_model: torch.nn.Module, args: TrainArgs, par: Parallel) -> None:
        self.model = ddp_model
        self.par = par
        self.max_norm = args.max_grad_norm
        self.params = [p for p in ddp_model.parameters() if p.requires_grad]
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        # Replicated params (norms under TP) count once in the global norm: only TP rank 0 adds theirs. Experts
        # under expert parallelism (megatron marks them allreduce=False) differ across the EP group: summed over it.
        counted = [p for p in self.params if param_is_not_tensor_parallel_duplicate(p)]
        self.norm_params = [p for p in counted if getattr(p, "allreduce", True)]
        self.expert_params = [p for p in counted if not getattr(p, "allreduce", True)]
        # The fused CPU kernel (as HF Trainer's default `adamw_torch_fused`): one multithreaded pass per tensor
        # instead of ~10 elementwise ops; its state dict is the same as the for-loop AdamW's.
        self.opt = torch.optim.AdamW(
            _param_groups(ddp_model, args.weight_decay), lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8, fused=True
        )

    @staticmethod
    def _squares(params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Sum of the squared grad norms: per-tensor fp32 norms (one kernel each), squared and summed in fp64."""
        grads = [p.grad for p in params if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64)
        if grads:
            sq += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        return sq

    def _grad_norm(self) -> float:
        """Global L2 norm of the grads (each expert counted once across the EP group, each shard across TP)."""
        sq = self._squares(self.norm_params)
        if self.par.ep_size > 1:
            experts = self._squares(self.expert_params)
            dist.all_reduce(experts, group=self.par.ep_group)
            sq += experts
        if self.par.tp_size > 1:
            dist.all_reduce(sq, group=self.par.tp_group)
        return float(sq.sqrt())

    def step(self, lr: float, after_sync: Callable[[], None] | None = None) -> float:
        finish_grad_sync(self.model, self.par.tp_size)
        if after_sync is not None:
            after_sync()
        for p in self.params:
            p.grad = p.main_grad  # megatron DDP reduces into main_grad; torch optimizers read .grad
        norm = self._grad_norm()
        coef = self.max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in self.params], coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        return norm

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.model.zero_grad_buffer()

    def set_adam(self, betas: tuple[float, float], eps: float, weight_decay: float, max_norm: float) -> None:
        decay, _ = self.opt.param_groups  # `_param_groups`: the matrices, then the norms and biases (never decayed)
        for group in self.opt.param_groups:
            group["betas"], group["eps"] = betas, eps
        decay["weight_decay"] = weight_decay
        self.max_norm = max_norm

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["adamw"])


def set_groups(groups: list[dict[str, Any]], lr: float, weight_decay: float) -> None:
    """The learning rate and weight decay of megatron's param groups for the next step. megatron marks the norms and
    biases `wd_mult` 0 but builds every group with the config's weight decay (its own training loop's LR scheduler
    applies the multiplier, and we use no megatron scheduler), so the decay is set here: matrices only, as HF
    Trainer and the CPU optimizer do."""
    for group in groups:
        group["lr"] = lr
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


class GpuDistributedOptimizer:
    """megatron-core's distributed optimizer (bf16 params, fp32 main params and grads, built-in clipping)."""

    def __init__(self, ddp_model: torch.nn.Module, args: TrainArgs, bf16: bool, tp_size: int = 1) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam",
            lr=args.learning_rate,
            weight_decay=args.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_eps=1e-8,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=True,
            clip_grad=args.max_grad_norm,
        )
        self.model = ddp_model
        self.config = config
        self.tp_size = tp_size
        self.weight_decay = args.weight_decay
        self.opt = get_megatron_optimizer(config, [ddp_model])

    def step(self, lr: float, after_sync: Callable[[], None] | None = None) -> float:
        finish_grad_sync(self.model, self.tp_size)
        if after_sync is not None:
            after_sync()
        set_groups(self.opt.param_groups, lr, self.weight_decay)
        _, grad_norm, _ = self.opt.step()
        return float(grad_norm or 0.0)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.opt.zero_grad()

    def set_adam(self, betas: tuple[float, float], eps: float, weight_decay: float, max_norm: float) -> None:
        for group in self.opt.param_groups:
            group["betas"], group["eps"] = betas, eps
        self.weight_decay = weight_decay
        for optimizer in self._sub_optimizers():
            optimizer.config.clip_grad = max_norm if math.isfinite(max_norm) else 0.0  # megatron: 0 = no clipping

    def _sub_optimizers(self) -> list[Any]:
        return list(getattr(self.opt, "chained_optimizers", [self.opt]))

    def state_dict(self) -> dict[str, Any]:
        """Per sub-optimizer: megatron's state dict and its parameter state (main params and moments), or None for
        one with no state yet. Before the first step there is nothing to keep: megatron's `state_dict` (torch AdamW,
        no TransformerEngine / Apex: our images') asserts one step count among no states."""
        subs = self._sub_optimizers()
        if not any(o.optimizer.state for o in subs):
            return {"megatron": None, "param_state": None}
        return {
            "megatron": [o.state_dict() if o.optimizer.state else None for o in subs],
            "param_state": [o.get_parameter_state_dp_reshardable() if o.optimizer.state else None for o in subs],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; a state saved before the first step gives a fresh optimizer (its main
        params from the model's current ones)."""
        if state["megatron"] is None:
            from megatron.core.optimizer import get_megatron_optimizer

            self.opt = get_megatron_optimizer(self.config, [self.model])
            return
        for o, saved, params in zip(self._sub_optimizers(), state["megatron"], state["param_state"]):
            if saved is None:
                continue
            o.load_state_dict(saved)
            # megatron 0.16's loader skips the entries its sharded format marks `padding`; the plain format it
            # saves (`get_parameter_state_dp_reshardable`) has no such key, and none is padding.
            for key, by_dtype in params.items():
                for buckets in by_dtype.values() if isinstance(key, int) else ():
                    for entry in (e for bucket in buckets for e in bucket):
                        entry.setdefault("padding", False)
            with torch.no_grad():  # fp32 params' main params are views of the params, which require grad
                o.load_parameter_state_from_dp_reshardable(params)
            # megatron's load (without TransformerEngine / Apex) gives every param's state one shared `step` tensor,
            # which torch's AdamW would then advance once per param each step (a wrong bias correction).
            for param_state in o.optimizer.state.values():
                if "step" in param_state:
                    param_state["step"] = param_state["step"].clone()


def build_optimizer(ddp_model: torch.nn.Module, args: TrainArgs, par: Parallel, bf16: bool) -> Optimizer:
    """The optimizer for this device: megatron's distributed optimizer on GPU, torch AdamW on CPU."""
    if par.on_gpu:
        return GpuDistributedOptimizer(ddp_model, args, bf16, par.tp_size)
    return CpuAdamW(ddp_model, args, par)
