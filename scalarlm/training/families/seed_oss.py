"""Seed-OSS (`SeedOssForCausalLM`: ByteDance's Seed-OSS-36B, base and instruct): Llama's layers with q/k/v biases (as
Qwen2, read from the tensor names) and dropout in training, which its checkpoints set to 0.1: on the attention
probabilities (`attention_dropout`) and on the attention's and the MLP's outputs before each residual add
(`residual_dropout`, megatron's hidden dropout), as transformers trains it. The train arg `disable_dropout` turns both
off. `attention_out_bias` (a bias on o_proj; the released models have none) is refused.
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("attention_out_bias"):
        raise InvalidRequest("attention_out_bias=true (a bias on o_proj) is not supported for seed_oss",
                             param="model")  # fmt: skip
    return {"hidden_dropout": float(config.get("residual_dropout") or 0.0)}


SEED_OSS = Family(
    name="seed_oss",
    architectures=("SeedOssForCausalLM",),
    qkv_bias_from_weights=True,
    extra=_extra,
    notes="Seed-OSS: Llama with q/k/v biases and residual dropout",
)
