"""The mixture-of-experts load-balancing loss: reported in every step's metrics, added to the objective when the
train arg `moe_aux_loss_coef` > 0 (megatron's `aux_loss` load balancing, its gradient; this module only measures).

Per MoE layer and micro-batch, over its T real tokens (the EP padding of `model._pad_to_the_group` excluded), with E
experts and top k (megatron's `switch_load_balancing_loss_func`):

    f_i = (tokens whose top k of the softmax include expert i) / (T k),   P_i = mean over the tokens of softmax_i
    load_balancing_loss = E * sum_i f_i P_i          (1.0 when the experts are used evenly)

with a sigmoid router (GLM-4.5) the sigmoid scores normalised to sum 1 in place of the softmax, as megatron's
`compute_routing_scores_for_aux_loss` (no expert bias, no groups).

The objective adds `coef` x the sum over MoE layers of that loss, each micro-batch weighted by its share of the
step's tokens on every DP rank (`aux_loss_scale`). That is megatron's per-layer convention: HF's
`router_aux_loss_coef` computes one loss over all layers together, so the same coefficient weighs it about
`layers` times less there. The metric `moe_load_balancing_loss` is the token-weighted mean over the step's
micro-batches of the mean over layers, over the tokens the forward passes compute: without a trained loss (coef 0, the
default) a GRPO step computes a shared prompt once and leaves out rows of advantage 0 (`rl_step.rl_batch`), so those
tokens count once or not at all.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

import torch
from torch import Tensor


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of every MoE layer of a megatron GPTModel, in layer order."""
    return [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]


def load_balancing_loss(logits: Tensor, topk: int, valid: Tensor | None = None, sigmoid: bool = False) -> Tensor:
    """megatron's switch load-balancing loss of one layer's router logits [N, E] over the `valid` tokens."""
    if valid is not None:
        logits = logits[valid]
    if sigmoid:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = torch.softmax(logits.float(), dim=-1)
    chosen = torch.zeros_like(scores).scatter(1, torch.topk(scores, k=topk, dim=1).indices, 1.0)
    tokens, experts = scores.shape
    f = chosen.sum(0) / (tokens * topk)
    p = scores.mean(0)
    return experts * (f * p).sum()


def _gathered(flat: Tensor, valid: Tensor | None, group) -> tuple[Tensor, Tensor]:
    """Every sequence-parallel rank's router logits and valid-token mask (equal shares), concatenated."""
    import torch.distributed as dist

    valid = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device) if valid is None else valid
    size = dist.get_world_size(group)
    logits, masks = [torch.empty_like(flat) for _ in range(size)], [torch.empty_like(valid) for _ in range(size)]
    dist.all_gather(logits, flat.contiguous(), group=group)
    dist.all_gather(masks, valid.contiguous(), group=group)
    return torch.cat(logits), torch.cat(masks)


class BalanceMeter:
    """Measures every MoE layer's load-balancing loss in the step driver's forward passes (not in the KL reference's,
    nor in activation recompute during backward): wraps each router's `routing`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        self.active = False
        self.layer_sum = 0.0  # sum over micro-batches of T x sum over layers
        self.tokens = 0
        self._micro_tokens = 0
        for router in self.routers:
            self._wrap(router)

    def _wrap(self, router: torch.nn.Module) -> None:
        inner = router.routing

        def routing(logits: Tensor, padding_mask: Tensor | None = None):
            if self.active:
                flat = logits.detach().reshape(-1, logits.shape[-1])
                valid = None if padding_mask is None else ~padding_mask.reshape(-1).bool()  # True on padding
                if router.config.sequence_parallel:  # this rank routes its share of the tokens: measure them all
                    flat, valid = _gathered(flat, valid, router.tp_cp_group)
                tokens = flat.shape[0] if valid is None else int(valid.sum())
                sigmoid = router.score_function == "sigmoid"
                self.layer_sum += float(load_balancing_loss(flat, router.topk, valid, sigmoid)) * tokens
                self._micro_tokens = tokens
            return inner(logits, padding_mask=padding_mask)

        router.routing = routing

    @contextmanager
    def forward_pass(self) -> Iterator[None]:
        """Measure the routers during one micro-batch's forward."""
        self.active, self._micro_tokens = True, 0
        try:
            yield
        finally:
            self.active = False
            self.tokens += self._micro_tokens

    def take(self) -> Tensor:
        """[sum over micro-batches of T x mean over layers, sum of T] since the last take (to sum over DP ranks)."""
        out = torch.tensor([self.layer_sum / max(len(self.routers), 1), float(self.tokens)], dtype=torch.float64)
        self.layer_sum, self.tokens = 0.0, 0
        return out


def aux_loss_scale(global_tokens: int) -> None:
    """Weigh each micro-batch's aux loss by its share of the step's `global_tokens` (megatron's router multiplies the
    loss by the micro-batch's token count when `calculate_per_token_loss`; its backward scale is this). Once per
    step: also empties megatron's own per-layer logging tracker, which only ever adds up (the metric is ours)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / max(global_tokens, 1)))
    get_moe_layer_wise_logging_tracker().clear()


@contextmanager
def no_aux_gradient() -> Iterator[None]:
    """Around the backward of a micro-batch that must train nothing (an expert-parallel filler): its aux loss gets a
    zero scale, then the step's scale is back."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    saved = None if scale is None else scale.clone()
    MoEAuxLossAutoScaler.set_loss_scale(torch.zeros(()))
    try:
        yield
    finally:
        if saved is None:
            MoEAuxLossAutoScaler.main_loss_backward_scale = None
        else:
            MoEAuxLossAutoScaler.set_loss_scale(saved)
