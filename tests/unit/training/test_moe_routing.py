"""DeepSeek-V2's softmax routing: the megatron config `transformer_config` builds from the family's fields, run
through megatron's routing function (what its `TopKRouter` calls), gives transformers' experts and weights per
token, greedy (V2-Lite) and group-limited; and the group-limited configs the family refuses would not."""

from __future__ import annotations

import pytest
import torch

from scalarlm.training.model import transformer_config
from tests.unit.training.deepseek_configs import DEEPSEEK_V2_GROUPS, DEEPSEEK_V2_LITE, deepseek_arch

TOKENS = 512


def _transformers_probs(config: dict, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' DeepSeek-V2 router as a [tokens, experts] matrix of the chosen experts' weights."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    router = DeepseekV2TopkRouter(DeepseekV2Config(**{k: v for k, v in config.items() if k != "architectures"}))
    with torch.no_grad():
        router.weight.copy_(weight)
        _, weights, chosen = router(hidden)
    return torch.zeros(hidden.shape[0], weight.shape[0]).scatter(1, chosen, weights)


def _megatron_probs(config: dict, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    arch = deepseek_arch(config)
    mc = transformer_config(arch, tp=1, bf16=False)
    probs, routing_map = topk_routing_with_score_function(
        hidden @ weight.T, arch.moe_topk, use_pre_softmax=mc.moe_router_pre_softmax,
        num_groups=mc.moe_router_num_groups, group_topk=mc.moe_router_group_topk,
        scaling_factor=mc.moe_router_topk_scaling_factor, score_function=mc.moe_router_score_function)  # fmt: skip
    assert torch.equal(routing_map, probs > 0)
    return probs


@pytest.mark.parametrize("config", [DEEPSEEK_V2_LITE, DEEPSEEK_V2_GROUPS], ids=["greedy", "group_limited"])
def test_megatron_routes_every_token_as_transformers(config: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(config["n_routed_experts"], config["hidden_size"], generator=gen) * 0.1
    hidden = torch.randn(TOKENS, config["hidden_size"], generator=gen)
    ours, reference = _megatron_probs(config, hidden, weight), _transformers_probs(config, hidden, weight)
    assert torch.equal(ours > 0, reference > 0)  # the same experts for every token
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    # not renormalised: the chosen probabilities sum to less than `routed_scaling_factor` (on average 0.83 of it)
    assert reference.sum(1).mean() < 0.9 * config["routed_scaling_factor"]
    if config["topk_method"] == "group_limited_greedy":
        # the limit decides: the best experts over every group are not always the chosen ones
        greedy = _transformers_probs({**config, "topk_method": "greedy"}, hidden, weight)
        assert not torch.equal(greedy > 0, reference > 0)


def test_the_refused_group_limit_routes_other_experts_in_megatron() -> None:
    """DeepSeek-V2's own 6 experts from 3 of 8 groups (the family refuses it): transformers ranks a group by its best
    score, megatron by its top 2."""
    config = {**DEEPSEEK_V2_GROUPS, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2}
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, config["hidden_size"], generator=gen) * 0.1
    hidden = torch.randn(TOKENS, config["hidden_size"], generator=gen)
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    probs, _ = topk_routing_with_score_function(hidden @ weight.T, 4, use_pre_softmax=True, num_groups=4,
                                                group_topk=2, scaling_factor=16.0)  # fmt: skip
    assert not torch.equal(probs > 0, _transformers_probs(config, hidden, weight) > 0)
