"""StableLM (`StableLmForCausalLM`: stablelm-3b-4e1t, stablelm-2-1_6b and its chat/zephyr models, stable-code-3b):
Llama's layers with LayerNorms (with biases; `layer_norm_eps`), RoPE on the leading `partial_rotary_factor` of each
head (0.25 when absent, as transformers assumes), q/k/v biases where the checkpoint has them (`use_qkv_bias`), none on
o_proj or the SwiGLU MLP, untied embeddings. vLLM 0.32.0's StableLM serves no LoRA adapter: the engine gets no LoRA
slots for it and serves each adapter merged into the base (inference/hot_swap.py).
Refused, as vLLM 0.32.0 would serve them otherwise than transformers: `use_parallel_residual` and `qk_layernorm`
(stablelm-2-12b's; vLLM builds the sequential layer without q/k norms), and `hidden_dropout` (transformers drops the
MLP's output only, not attention's).
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family


def _refuse(config: dict[str, Any]) -> None:
    for name in ("use_parallel_residual", "qk_layernorm"):
        if config.get(name):
            raise InvalidRequest(f"{name}=true is not supported for stablelm: vLLM 0.32.0 serves the sequential layer "
                                 "without q/k norms whatever the config says (stablelm-2-12b sets both)",
                                 param="model")  # fmt: skip
    if config.get("hidden_dropout"):
        raise InvalidRequest(f"hidden_dropout={config['hidden_dropout']} is not supported for stablelm (transformers "
                             "drops the MLP's output only): set it to 0", param="model")  # fmt: skip


STABLELM = Family(
    name="stablelm",
    architectures=("StableLmForCausalLM",),
    partial_rotary=0.25,
    qkv_bias_from_weights=True,
    refuse=_refuse,
    extra=lambda config: {"layer_norm": True, "norm_eps": float(config.get("layer_norm_eps") or 1e-5)},
    notes="StableLM 2 / 3B-4E1T: LayerNorm, partial RoPE, q/k/v biases",
)
