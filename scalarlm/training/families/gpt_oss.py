"""GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b, in bf16): grouped-query attention with biases on q, k, v
and the output, a learned sink logit per head in every softmax (`self_attn.sinks`), sliding-window and full layers
alternating (`layer_types`), YaRN RoPE; every MLP a top-k mixture of experts routed by a linear layer with a bias
(`mlp.router`: softmax over the top k logits, Mixtral's routing).

The experts are stored stacked and multiplied as x @ W (`interleaved_experts`): `mlp.experts.gate_up_proj` [E, H, 2I]
holds each expert's gate and up interleaved by column (gate first), `down_proj` [E, I, H], each with a `_bias`. Their
activation is the clamped SwiGLU of the released models: gate clamped above at `swiglu_limit`, up to +-limit, then
(up + 1) * gate * sigmoid(1.702 * gate); megatron's MLP computes the same with `activation_func_clamp_value` and
`glu_linear_offset` 1 around quick_gelu.

Refused, naming the field: the hub's MXFP4 checkpoints (`quantization_config`: `scalarlm dequantize` writes the bf16
copy the trainer trains and vLLM serves and hot-swaps, `training/dequantize.py`); what vLLM 0.32.0 serves differently
from transformers (it hard-codes swiglu alpha
1.702 and limit 7, YaRN, and a window on the even layers only); LoRA (as every MoE family).
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.moe import EXPERT_LORA, top_k_experts
from scalarlm.training.families.spec import Family, layer_type_windows

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # what vLLM 0.32.0's GPT-OSS computes, whatever the config says


def _refuse(config: dict[str, Any]) -> None:
    """What transformers would train but vLLM would serve differently."""
    for name, served in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        value = config.get(name)
        if value is not None and float(value) != served:
            raise InvalidRequest(f"{name}={value} is not supported: vLLM 0.32.0's GPT-OSS computes {served} whatever "
                                 "the config says (the released models' value)", param="model")  # fmt: skip
    layers, types = int(config["num_hidden_layers"]), config.get("layer_types")
    served_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if config.get("sliding_window") is not None and types is not None and list(types) != served_types:
        raise InvalidRequest(f"layer_types {types}: vLLM 0.32.0's GPT-OSS slides the window on the even layers and "
                             "attends fully on the odd ones (as the released models do)", param="model")  # fmt: skip


def _windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """`sliding_window` on the "sliding_attention" layers (transformers' default `layer_types`: the even layers)."""
    if config.get("layer_types") is None:
        config = {**config, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(layers)]}  # fmt: skip
    return layer_type_windows(config, layers, True)


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    """Every layer's experts: top k of the router's logits softmaxed, stacked and interleaved as the hub stores them;
    the biases, sinks and clamped activation."""
    return {
        **top_k_experts(config, True),
        "moe_ffn_hidden_size": int(config["intermediate_size"]),
        "expert_names": ("mlp", "router", "experts.gate_up_proj", "", "experts.down_proj"),
        "interleaved_experts": True,
        "linear_bias": True,
        "attention_sinks": True,
        "glu_clamp": float(config.get("swiglu_limit") or SWIGLU_LIMIT),
        "activation": "quick_gelu",
    }


GPT_OSS = Family(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    qkv_bias_from_weights=True,
    rope_types=frozenset({"yarn"}),
    windows=_windows,
    refuse=_refuse,
    extra=_extra,
    lora_excluded=EXPERT_LORA,
    notes="GPT-OSS: attention sinks, biases, alternating windows, YaRN; experts stacked with gate/up interleaved",
)
