"""Routing replay for GRPO on mixture-of-experts models, through megatron-core's `RouterReplay` (the router's own hook:
`moe_enable_routing_replay`, on for every MoE model we build).

With `num_iterations` > 1 a batch of groups is trained over several optimizer steps. The first step's forward pass
over each micro-batch records every MoE layer's chosen experts (RECORD); the later steps' forwards, with
`routing_replay`, use those choices instead of the router's new ones (REPLAY_FORWARD, and REPLAY_BACKWARD for
activation recompute), so the policy ratio compares the same experts while the router's weights move. The sampler's
own choices would be better still, but vLLM 0.32 returns routed experts only from its GPU model runner (V2, which
needs Triton); on a CPU engine the first pass is what there is.

Either way (replay on or off), the later steps count the tokens whose own top-k experts now differ, in any MoE
layer, from the first pass's: the metric `moe_routing_changed_fraction` (changed (token, layer) pairs / compared
ones, the EP padding left out).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from scalarlm.training.moe_balance import moe_routers


class RoutingReplay:
    """Records each micro-batch's expert choices on a batch's first pass; replays (if `replay`) and compares them on
    the batch's later passes."""

    def __init__(self, model: torch.nn.Module, replay: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.action = RouterReplayAction
        self.routers = moe_routers(model)
        self.replay = replay
        self.recorded: list[list[Tensor]] = []  # [micro-batch][MoE layer] -> [tokens, top k] expert ids
        self.counts = torch.zeros(2, dtype=torch.float64)  # changed, compared (since the last `take_counts`)
        self._targets: list[Tensor] | None = None
        for layer, router in enumerate(self.routers):
            self._wrap(router, layer)

    def _wrap(self, router: torch.nn.Module, layer: int) -> None:
        inner = router.routing

        def routing(logits: Tensor, padding_mask: Tensor | None = None):
            if self._targets is not None:
                flat = logits.detach().reshape(-1, logits.shape[-1])
                own = torch.topk(flat, k=router.topk, dim=1).indices.sort(dim=1).values  # top k of logits = of softmax
                changed = (own != self._targets[layer].to(own.device).sort(dim=1).values).any(dim=1)
                if padding_mask is not None:
                    changed = changed[~padding_mask.reshape(-1).bool()]  # megatron's mask: True on padding
                self.counts += torch.tensor([float(changed.sum()), float(changed.numel())], dtype=torch.float64)
            return inner(logits, padding_mask=padding_mask)

        router.routing = routing

    def new_batch(self) -> None:
        self.recorded = []

    @contextmanager
    def forward_pass(self, micro: int) -> Iterator[None]:
        """Around micro-batch `micro`'s forward: record its choices (the batch's first pass) or compare with, and if
        `replay` reuse, the recorded ones."""
        replays = [r.router_replay for r in self.routers]
        first = micro >= len(self.recorded)
        for layer, rr in enumerate(replays):
            rr.clear_indices()
            if first:
                rr.set_router_replay_action(self.action.RECORD)
            elif self.replay:
                rr.set_target_indices(self.recorded[micro][layer])
                rr.set_router_replay_action(self.action.REPLAY_FORWARD)
            else:
                rr.clear_router_replay_action()
        self._targets = None if first else self.recorded[micro]
        try:
            yield
        finally:
            self._targets = None
            if first:
                self.recorded.append([rr.get_recorded_indices().detach().clone() for rr in replays])
            for rr in replays:
                if not first and self.replay:
                    rr.set_router_replay_action(self.action.REPLAY_BACKWARD)  # activation recompute, in backward
                else:
                    rr.clear_router_replay_action()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The routers on their own choices inside the block, uncounted, then each router's replay state back: the
        LoRA KL reference (the same model, adapters off) routes as the base does, and the policy's activation
        recompute in backward still finds its recorded choices."""
        replays = [r.router_replay for r in self.routers]
        saved = [(rr.router_replay_action, list(rr.replay_backward_list)) for rr in replays]
        targets, self._targets = self._targets, None
        for rr in replays:
            rr.clear_router_replay_action()
        try:
            yield
        finally:
            self._targets = targets
            for rr, (action, backward) in zip(replays, saved):
                rr.router_replay_action = action
                rr.replay_backward_list = backward

    def done(self) -> None:
        """After the step: routers back to their own choices."""
        for router in self.routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()

    def take_counts(self) -> Tensor:
        """[changed, compared] since the last call (under sequence parallelism over every TP rank's share of the
        tokens: one all-reduce)."""
        out, self.counts = self.counts, torch.zeros(2, dtype=torch.float64)
        router = self.routers[0] if self.routers else None
        if router is not None and router.config.sequence_parallel:
            import torch.distributed as dist

            # on the router's device: the group is NCCL's on a GPU, which takes no CPU tensor
            on_device = out.to(router.weight.device)
            dist.all_reduce(on_device, group=router.tp_cp_group)
            out = on_device.cpu()
        return out
