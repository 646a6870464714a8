"""The one step driver of SFT, GRPO and session steps: per micro-batch one forward, a loss function, one backward;
then one optimizer step. What differs between the losses is only their micro-batches and their `LossFn`.

* Micro-batches are padding-free (`data.collate_packed`): documents end to end in one [1, T] row, attention within
  each document.
* DP: with the trainer's overlapped all-reduce, every micro-batch but the last runs under `no_sync()`, so the last
  backward starts each bucket's all-reduce as soon as its grads are final (overlapped with the rest of backward).
  Megatron issues that all-reduce when every param has reported its grads the same number of times as in the first
  step, so every step runs exactly one backward with sync on: a rank with no micro-batch (fewer documents than DP
  ranks) backpropagates a zero through every param instead of running a forward nobody needs.
* Expert parallelism: every rank of an expert group must run as many forwards and backwards (the dispatcher's
  collectives). A rank short of micro-batches runs fillers (`data.filler_micro`): one pad token whose loss, stats,
  load-balancing metric and aux gradient are zero, backpropagated through every param.
* Stats: each loss function returns a fixed-length float64 vector summed over micro-batches and, in one
  all-reduce, over DP ranks (the loss itself is its first entry). Mixture-of-experts models add the load-balancing
  loss (`moe_balance`) to that all-reduce; with `moe_aux_loss_coef` > 0 each micro-batch's aux loss is weighted by
  its share of the step's tokens on every rank (one more all-reduce, of the token count, before the first forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from scalarlm.training.data import MicroBatch
from scalarlm.training.losses import token_losses
from scalarlm.training.moe_balance import aux_loss_scale, no_aux_gradient

if TYPE_CHECKING:
    from scalarlm.training.loop import Trainer

# (index of the micro-batch, the micro-batch on the device, its per-token cross-entropy [1, T], 0 off its loss mask) ->
# (its share of the step's loss, to backpropagate; a float64 vector of stats to sum over the step).
LossFn = Callable[[int, MicroBatch, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step measured: stats summed over micro-batches and DP ranks, LR, grad norm, seconds."""

    sums: Tensor
    lr: float
    grad_norm: float
    seconds: float
    moe: dict[str, float]


def overlaps_all_reduce(ddp: torch.nn.Module) -> bool:
    """True when `ddp` starts its grad all-reduce during backward (DP > 1 with overlap on)."""
    return bool(getattr(getattr(ddp, "ddp_config", None), "overlap_grad_reduce", False))


def _zero_term(ddp: torch.nn.Module) -> Tensor:
    """A zero that depends on every trained param: backpropagated, each reports a zero grad."""
    params = [p for p in ddp.parameters() if p.requires_grad]
    return torch.stack([p.reshape(-1)[0] for p in params]).mul(0.0).sum()


def _zero_backward(ddp: torch.nn.Module) -> None:
    """Backpropagate a zero through every trained param (a rank without data still reports its grads, so the
    overlapped all-reduce of the other ranks' grads runs: no forward pass)."""
    _zero_term(ddp).backward()


def run_step(trainer: "Trainer", micro_batches: Sequence[MicroBatch], loss_fn: LossFn, n_stats: int,
             around_forward: Callable[[int], AbstractContextManager] | None = None) -> StepResult:  # fmt: skip
    """One optimizer step of `loss_fn` over this rank's `micro_batches` (zero or more); bumps `trainer.step`.
    `around_forward(i)` wraps micro-batch i's forward (GRPO's routing replay)."""
    start = time.perf_counter()
    par, ddp = trainer.par, trainer.ddp
    ddp.train()
    trainer.optimizer.zero_grad()
    sums = torch.zeros(n_stats, dtype=torch.float64, device=par.device)
    balance = trainer.balance
    if balance is not None and trainer.args.trains_balance_loss:
        aux_loss_scale(_global_tokens(micro_batches, par))
    last = len(micro_batches) - 1
    for i, micro in enumerate(micro_batches):
        micro = micro.to(par.device)
        measured = balance is not None and not micro.filler
        with nullcontext() if i == last else ddp.no_sync():  # the last backward starts the all-reduce
            with balance.forward_pass() if measured else nullcontext():
                with around_forward(i) if around_forward is not None else nullcontext():
                    token_loss = token_losses(ddp, micro, loss_only=True)
            loss, stats = loss_fn(i, micro, token_loss)
            if micro.filler:  # trains nothing, but every param reports (a rank may have only fillers)
                loss = loss * 0.0 + _zero_term(ddp)
            with no_aux_gradient() if micro.filler and balance is not None else nullcontext():
                loss.backward()
        if not micro.filler:
            sums += stats.to(sums.device, torch.float64)
    if not micro_batches and overlaps_all_reduce(ddp):
        _zero_backward(ddp)
    lr, grad_norm = trainer.optimizer_step()
    if balance is not None:
        sums = torch.cat([sums, balance.take().to(sums.device)])
    if par.dp_size > 1:
        dist.all_reduce(sums, group=par.dp_group)
    trainer.step += 1
    moe = {}
    if balance is not None:
        sums, (weighted, tokens) = sums[:n_stats], sums[n_stats:].tolist()
        if tokens:  # a step that computed no token (every GRPO row left out) measured nothing: no figure
            moe["moe_load_balancing_loss"] = weighted / tokens
    return StepResult(sums, lr, grad_norm, time.perf_counter() - start, moe)


def _global_tokens(micro_batches: Sequence[MicroBatch], par) -> int:
    """Tokens in this step's micro-batches on every DP rank."""
    count = torch.tensor([sum(m.tokens.numel() for m in micro_batches if not m.filler)], dtype=torch.int64,
                         device=par.device)  # fmt: skip
    if par.dp_size > 1:
        dist.all_reduce(count, group=par.dp_group)
    return int(count)


def start_accumulated_sync(ddp: torch.nn.Module) -> None:
    """Start the DP all-reduce of grads accumulated by backwards all run under `no_sync()` (Tinker's
    forward_backward calls): with overlap the optimizer step only waits for an all-reduce already issued."""
    if overlaps_all_reduce(ddp):
        ddp.start_grad_sync()
