"""ScalarLM's (and PEFT's) names for train args we call otherwise are accepted as ours, through the control plane's
parser: `gradient_clip_value` (max_grad_norm), `lora_config.lora_alpha` / `lora_dropout` and
`target_modules: "all-linear"`; both names with different values is a 400 naming them."""

from __future__ import annotations

import pytest

from scalarlm.config import TrainingSettings
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import DEFAULT_TARGETS
from scalarlm.server.jobs import parse_train_args


def test_scalarlm_names_are_ours() -> None:
    upstream = {"gradient_clip_value": 0.5, "lora_config": {"r": 4, "lora_alpha": 32, "lora_dropout": 0.1,
                                                            "target_modules": "all-linear"}}  # fmt: skip
    args = parse_train_args(upstream, TrainingSettings())
    assert args.max_grad_norm == 0.5
    assert (args.lora_config.r, args.lora_config.alpha, args.lora_config.dropout) == (4, 32.0, 0.1)
    assert args.lora_config.target_modules == [DEFAULT_TARGETS]  # the family's default targets
    same = parse_train_args({"gradient_clip_value": 2.0, "max_grad_norm": 2.0}, TrainingSettings())
    assert same.max_grad_norm == 2.0
    dumped = parse_train_args(args.model_dump(), TrainingSettings())  # what job.yaml holds reads back the same
    assert dumped.lora_config == args.lora_config and dumped.max_grad_norm == 0.5


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"gradient_clip_value": 0.5, "max_grad_norm": 1.0}, "'gradient_clip_value' and 'max_grad_norm'"),
        ({"lora_config": {"lora_alpha": 8, "alpha": 16}}, "'lora_alpha' and 'alpha'"),
        ({"lora_config": {"target_modules": "all"}}, "lora_config.target_modules"),
    ],
)
def test_two_names_that_disagree_are_a_400(params: dict, words: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_train_args(params, TrainingSettings())
    assert err.value.status_code == 400 and words in err.value.message, err.value.message
