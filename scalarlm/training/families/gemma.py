"""Gemma 3 (text, `Gemma3ForCausalLM`), Gemma 2 (`Gemma2ForCausalLM`), Gemma 1 (`GemmaForCausalLM`), and the
recognised families the trainer refuses, each with the reason.

Gemma 3 differs from Llama in ways megatron-core 0.16.1 has no module for; `modules.py` adds them, driven by
`ModelArch` fields: zero-centred `(1 + w)` RMSNorm computed in fp32 (all norms, q/k norms included), embeddings
scaled by sqrt(hidden_size), output norms after attention and after the MLP (HF's `post_attention_layernorm` is
one of them, not the pre-MLP norm), GeGLU with tanh GELU, attention scale `query_pre_attn_scalar ** -0.5`,
per-layer sliding windows (`layer_types`) and a second RoPE base for the sliding layers; `linear` RoPE scaling
(Gemma 3 4B+) on the global layers. Gemma 2 shares the norms, GeGLU, embedding scale and attention scalar, has no
q/k norms and one RoPE base, alternates sliding and global layers, and soft-caps the attention scores and the final
logits (`cap * tanh(x / cap)`, `attn_logit_softcap` / `final_logit_softcap`). Gemma 1 (Gemma 2B/7B, 1.1, CodeGemma)
is Llama's layers with Gemma's norms, embedding scale and GeGLU: no output norms, windows, caps or attention scalar
(head_dim ** -0.5). Its hub configs say `hidden_act` "gelu" beside `hidden_activation` "gelu_pytorch_tanh" (the
GeLU it was trained with); the trainer reads `hidden_activation` first, as vLLM does (transformers 5 reads only
`hidden_act`). Bidirectional attention is refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family, Refused, TextInside, layer_type_windows, pattern_layer_types


def _rope(params: dict[str, Any] | None, where: str, default_theta: float) -> tuple[float, float | None]:
    """(theta, linear factor) of one layer type's RoPE parameters."""
    params = params or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear"):
        raise InvalidRequest(f"{where}.rope_type {rope_type!r} is not supported for gemma3 "
                             "(supported: ['default', 'linear'])", param="model")  # fmt: skip
    theta = float(params.get("rope_theta") or default_theta)
    return theta, float(params["factor"]) if rope_type == "linear" else None


def _gemma_common(config: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share: causal attention only, (1 + w) norms, sqrt(hidden) embedding scale, attention scale."""
    if config.get("use_bidirectional_attention"):
        raise InvalidRequest("use_bidirectional_attention=true is not supported", param="model")
    return {
        "norm_offset": True,
        "embedding_multiplier": int(config["hidden_size"]) ** 0.5,
        "softmax_scale": float(config.get("query_pre_attn_scalar") or config.get("head_dim") or 256) ** -0.5,
    }


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(name) is not None:
            raise InvalidRequest(f"{name}={config[name]} (soft-capping) is not supported", param="model")
    common = _gemma_common(config)
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5: per layer type
        full, full_where = params.get("full_attention"), "rope_parameters.full_attention"
        local, local_where = params.get("sliding_attention"), "rope_parameters.sliding_attention"
    else:  # transformers 4.x: rope_theta + rope_scaling (global layers), rope_local_base_freq
        full, full_where = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta")}, "rope_scaling"
        local, local_where = {"rope_theta": config.get("rope_local_base_freq")}, "rope_local_base_freq"
    theta, factor = _rope(full, full_where, 1_000_000.0)
    local_theta, local_factor = _rope(local, local_where, 10_000.0)
    if local_factor is not None:
        raise InvalidRequest(f"{local_where}: RoPE scaling on the sliding layers is not supported", param="model")
    return {"rope_theta": theta, "rope_linear_factor": factor, "local_rope_theta": local_theta, **common}


def _gemma2_extra(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2: Gemma's norms, embedding scale and attention scalar; soft-capping; one plain RoPE base."""
    common = _gemma_common(config)
    params = config.get("rope_parameters") or {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta")}
    theta, factor = _rope(params, "rope_parameters", 10_000.0)
    if factor is not None:
        raise InvalidRequest("rope_parameters: RoPE scaling is not supported for gemma2", param="model")
    caps = {}
    for name, field in (("attn_logit_softcapping", "attn_logit_softcap"),
                        ("final_logit_softcapping", "final_logit_softcap")):  # fmt: skip
        value = config.get(name)
        if value is not None and not float(value) > 0:
            raise InvalidRequest(f"{name}={value}: a soft cap must be positive (or null for none)", param="model")
        caps[field] = float(value) if value is not None else None
    return {"rope_theta": theta, **common, **caps}


def _gemma2_windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Gemma 2's `layer_types` (sliding, global, sliding, ... when absent, as transformers derives it)."""
    return _windows({**config, "sliding_window_pattern": 2}, layers)


def _windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Gemma 3's `layer_types` (derived from `sliding_window_pattern` when absent, as transformers does)."""
    if config.get("sliding_window") is not None:
        config = {**config, "layer_types": pattern_layer_types(config, layers, 6)}
    return layer_type_windows(config, layers, True)


def _gemma1_extra(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 1: Gemma's norms and embedding scale, one plain RoPE base (`rope_types` refuses scaling)."""
    if config.get("query_pre_attn_scalar") is not None:
        raise InvalidRequest("query_pre_attn_scalar is not a Gemma 1 field (Gemma 2 and 3 have it); check "
                             "`architectures`", param="model")  # fmt: skip
    return _gemma_common(config)


GEMMA3 = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    qk_layernorm=True,
    activations=frozenset({"gelu_pytorch_tanh"}),
    sandwich_norms=True,
    windows=_windows,
    extra=_extra,
    notes="Gemma 3 text: (1 + w) norms, sandwich norms, GeGLU, two RoPE bases, per-layer windows",
)

# transformers' Gemma3TextConfig defaults: the hub's multimodal configs (Gemma 3 4B-27B) write only what differs
# (test_families checks these against transformers').
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
}  # fmt: skip


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 config's text model, as transformers reads it (its defaults under `text_config`); the
    checkpoint's `architectures`, and its tie flag where the top level sets one."""
    text = {**GEMMA3_TEXT_DEFAULTS, **(config.get("text_config") or {})}
    tied = config.get("tie_word_embeddings")
    return {**text, "architectures": config.get("architectures"),
            "tie_word_embeddings": text["tie_word_embeddings"] if tied is None else tied}  # fmt: skip


GEMMA3_MM = replace(
    GEMMA3,
    name="gemma3_mm",
    architectures=("Gemma3ForConditionalGeneration",),
    read_config=_text_config,
    # As transformers 4.50 and 5 save it (the hub's), and as 4.52-4.57 saved it (their module tree's names).
    text_inside=(
        TextInside(("language_model.model.embed_tokens", "language_model.model.layers", "language_model.model.norm",
                    "language_model.lm_head"), ("vision_tower.", "multi_modal_projector.")),
        TextInside(("model.language_model.embed_tokens", "model.language_model.layers", "model.language_model.norm",
                    "lm_head"), ("model.vision_tower.", "model.multi_modal_projector.")),
    ),  # fmt: skip
    adapter_layers="model.language_model.layers",  # PEFT's keys on transformers 5's module tree
    notes="Gemma 3 4B-27B (multimodal): its text model trained as Gemma 3's, the vision tower and projector kept",
)

GEMMA2 = Family(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    activations=frozenset({"gelu_pytorch_tanh"}),
    sandwich_norms=True,
    windows=_gemma2_windows,
    extra=_gemma2_extra,
    notes="Gemma 2: (1 + w) norms, sandwich norms, GeGLU, alternating windows, attention and final soft-capping",
)

GEMMA = Family(
    name="gemma",
    architectures=("GemmaForCausalLM",),
    activations=frozenset({"gelu_pytorch_tanh"}),
    extra=_gemma1_extra,
    notes="Gemma 1: (1 + w) norms, embeddings x sqrt(hidden), GeGLU (tanh)",
)

REFUSED = (
    Refused(("PhimoeForCausalLM",),
            "PhiMoE's sparsemixer routing is not supported (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, DeepSeek-V2/V3 "
            "and OLMoE are)"),  # fmt: skip
)
