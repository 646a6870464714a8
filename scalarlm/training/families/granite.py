"""Granite 3.x dense (`GraniteForCausalLM`, IBM): Llama's layers with four scalar multipliers from the config.

The embeddings are multiplied by `embedding_multiplier`, the attention scores scaled by `attention_multiplier` (in
place of head_dim ** -0.5), each attention and MLP output multiplied by `residual_multiplier` before its residual add,
and the output logits divided by `logits_scaling`, as transformers and vLLM compute them.
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family


def _multipliers(config: dict[str, Any]) -> dict[str, Any]:
    """The four scalars (transformers' defaults, 1.0, when absent); each must be positive."""
    values = {}
    for name in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
        value = config.get(name)
        value = 1.0 if value is None else float(value)
        if not value > 0:
            raise InvalidRequest(f"{name}={config[name]}: Granite's multipliers must be positive", param="model")
        values[name] = value
    return {
        "embedding_multiplier": values["embedding_multiplier"],
        "softmax_scale": values["attention_multiplier"],
        "residual_multiplier": values["residual_multiplier"],
        "logits_divisor": values["logits_scaling"],
    }


GRANITE = Family(
    name="granite",
    architectures=("GraniteForCausalLM",),
    extra=_multipliers,
    notes="Granite 3.x dense: embedding, attention, residual multipliers and logits scaling",
)
