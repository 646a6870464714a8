"""ERNIE 4.5 dense (`Ernie4_5ForCausalLM`: Baidu's ERNIE-4.5-0.3B, base and post-trained): Llama's layers with RoPE
rotating adjacent pairs of dims (GPT-J style, megatron's `rotary_interleaved`; vLLM serves it as Llama with
`is_neox_style` off) and tied embeddings in the released model. `use_bias` (biases on every projection) is refused:
vLLM reads no such field and would serve the model without them.
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("use_bias"):
        raise InvalidRequest("use_bias=true is not supported for ernie4_5 (vLLM 0.32.0 reads no such field and would "
                             "serve the model without its biases)", param="model")  # fmt: skip
    return {}


ERNIE4_5 = Family(
    name="ernie4_5",
    architectures=("Ernie4_5ForCausalLM",),
    rotary_interleaved=True,
    extra=_extra,
    notes="ERNIE 4.5 dense: Llama with adjacent-pair (GPT-J style) RoPE",
)
