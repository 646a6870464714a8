"""Granite 3.x dense (`GraniteForCausalLM`, IBM): Llama's layers with four scalar multipliers from the config.

The embeddings are multiplied by `embedding_multiplier`, the attention scores scaled by `attention_multiplier` (in
place of head_dim ** -0.5), each attention and MLP output multiplied by `residual_multiplier` before its residual add,
and the output logits divided by `logits_scaling`, as transformers and vLLM compute them.

Granite 3.x MoE (`GraniteMoeForCausalLM`: granite-3.0-1b-a400m, -3b-a800m, granite-3.1 likewise) is the same layers
with every MLP a top-k mixture of experts, Mixtral's routing (softmax over the top k logits), stored as two stacked
tensors per layer: `block_sparse_moe.input_linear` [E, 2I, H] (each expert's [gate; up]) and `output_linear` [E, H, I],
routed by `block_sparse_moe.router.layer`. Its sibling with a shared MLP beside the experts
(`GraniteMoeSharedForCausalLM`) is refused.

Granite 4.0's attention-only models (granite-4.0-micro, -1b, -350m; `GraniteMoeHybridForCausalLM` with every
`layer_types` entry "attention") are the same layers under other names: the MLP is `shared_mlp` with one fused
`input_linear` ([gate; up], of `shared_intermediate_size`) and `output_linear`; RoPE only where
`position_embedding_type` is "rope" (otherwise none at all). Their Mamba-2 layers (the -h models) and routed experts
are refused.
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.moe import EXPERT_LORA, top_k_experts
from scalarlm.training.families.spec import Family, Refused

GRANITE4_ATTENTION = ("attention", "full_attention")  # `layer_types` of an attention layer (transformers 5 renames it)


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


def _granite_moe_extra(config: dict[str, Any]) -> dict[str, Any]:
    """Granite 3 MoE: the multipliers, and every layer's experts as two stacked tensors (`stacked_experts`) routed by
    `router.layer`: the top k of the logits, softmaxed (= the renormalised top k)."""
    return {
        **_multipliers(config),
        **top_k_experts(config, True),
        "moe_ffn_hidden_size": int(config["intermediate_size"]),
        "expert_names": ("block_sparse_moe", "router.layer", "input_linear", "", "output_linear"),
        "stacked_experts": True,
    }


GRANITE_MOE = Family(
    name="granitemoe",
    architectures=("GraniteMoeForCausalLM",),
    extra=_granite_moe_extra,
    lora_excluded=EXPERT_LORA,
    notes="Granite 3.x MoE: Granite's multipliers + top-k experts stored stacked (block_sparse_moe.input_linear)",
)


def _granite4_refuse(config: dict[str, Any]) -> None:
    """Mamba-2 layers (transformers reads a config without `layer_types` as all Mamba) and routed experts."""
    types = config.get("layer_types") or config.get("layers_block_type")
    if not types or any(t not in GRANITE4_ATTENTION for t in types):
        others = sorted({t for t in types or ["mamba (no layer_types)"] if t not in GRANITE4_ATTENTION})
        raise InvalidRequest(f"layer_types {others}: Granite 4.0's Mamba-2 layers (the -h models) are not "
                             "supported; its attention-only models (granite-4.0-micro, -1b, -350m) are",
                             param="model")  # fmt: skip
    if config.get("num_local_experts"):
        raise InvalidRequest(f"num_local_experts={config['num_local_experts']}: Granite 4.0's routed experts are not "
                             "supported (its dense models, num_local_experts 0, are)", param="model")  # fmt: skip


def _granite4_extra(config: dict[str, Any]) -> dict[str, Any]:
    return {**_multipliers(config), "ffn_hidden_size": int(config["shared_intermediate_size"])}


GRANITE4 = Family(
    name="granite4",
    architectures=("GraniteMoeHybridForCausalLM",),
    fused_gate_up=True,
    mlp_names=("shared_mlp", "input_linear", "output_linear"),
    refuse=_granite4_refuse,
    rope_layers=lambda config, layers: () if config.get("position_embedding_type") == "rope" else (False,) * layers,
    extra=_granite4_extra,
    notes="Granite 4.0 attention-only: Granite 3's multipliers, shared_mlp.input_linear ([gate; up]) / output_linear",
)

REFUSED = (
    Refused(("GraniteMoeSharedForCausalLM",),
            "Granite's MoE with a shared MLP beside the experts is not supported (GraniteMoeForCausalLM is)"),
)
