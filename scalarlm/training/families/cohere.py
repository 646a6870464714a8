"""Cohere (`CohereForCausalLM`: Command R, Command R+, Aya 23, Aya Expanse 8B/32B) and Cohere2 (`Cohere2ForCausalLM`:
Command R7B, Command A): attention and the MLP side by side on one input norm, `x + attn(norm(x)) + mlp(norm(x))`
(megatron's sequential layer with the MLP reading the attention's normed input: `modules.apply_parallel_blocks`);
LayerNorm without a bias, computed in fp32 (`layer_norm_eps`); RoPE on adjacent pairs of dims; a SwiGLU MLP; output
logits multiplied by `logit_scale`; tied embeddings. Command R+ (`use_qk_norm`) adds LayerNorms over each head of q
and k before RoPE, with a weight per head (`qk_norm_per_head`: `modules.apply_head_qk_norms`). Cohere2 adds
sliding-window layers (`layer_types`, or every `sliding_window_pattern`-th layer full, as transformers derives it)
and leaves RoPE out of its full-attention layers.

Refused: a Cohere config without its RoPE fields (transformers would assume base 500000), `use_qk_norm` on Cohere2
(transformers' Cohere2 has none). vLLM 0.32.0 serves Cohere2's sliding layers with one key more than transformers
(window + 1, Cohere's training convention by vLLM's account); the trainer follows transformers, so a served answer can
differ past the window (4096 in Command R7B).
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family, layer_type_windows, pattern_layer_types, refuse_without_rope


def _refuse_qk_norm(config: dict[str, Any]) -> None:
    """Cohere2: transformers' Cohere2 has no q/k norms (vLLM's Command R module would apply them)."""
    if config.get("use_qk_norm"):
        raise InvalidRequest("use_qk_norm=true is not supported for cohere2 (transformers' Cohere2 has no q/k norms: "
                             "Command R+'s are CohereForCausalLM)", param="model")  # fmt: skip


def _refuse(config: dict[str, Any]) -> None:
    """Cohere's: transformers' CohereConfig assumes RoPE base 500000 where a config has none (Cohere2Config assumes
    10000, the common reader's base)."""
    refuse_without_rope(config, "cohere", "a RoPE base of 500000")


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    scale = config.get("logit_scale")
    scale = 0.0625 if scale is None else float(scale)  # transformers' default (Command R's)
    if not scale > 0:
        raise InvalidRequest(f"logit_scale={config['logit_scale']} must be positive", param="model")
    return {"layer_norm": True, "norm_bias": False, "norm_eps": float(config.get("layer_norm_eps") or 1e-5),
            "logits_divisor": 1.0 / scale}  # fmt: skip


def _cohere_extra(config: dict[str, Any]) -> dict[str, Any]:
    """Cohere's, with Command R+'s `use_qk_norm`: a LayerNorm over each head of q and k, a weight per head."""
    return {**_extra(config), "qk_norm_per_head": bool(config.get("use_qk_norm"))}


def _layer_types(config: dict[str, Any]) -> dict[str, Any]:
    """Cohere2's config with `layer_types` as transformers derives them when the config has none (older hub configs
    carry `sliding_window_pattern`: every pattern-th layer full)."""
    return {**config, "layer_types": pattern_layer_types(config, int(config["num_hidden_layers"]), 4)}


def _windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    return layer_type_windows(config, layers, True)


def _rope_layers(config: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """RoPE on the sliding-window layers only (transformers: on the layers with a window, so none without one)."""
    windows = _windows(config, layers)
    return tuple(w is not None for w in windows) if windows else (False,) * layers


COHERE = Family(
    name="cohere",
    architectures=("CohereForCausalLM",),
    rotary_interleaved=True,
    parallel_block=True,
    refuse=_refuse,
    extra=_cohere_extra,
    notes="Command R / Aya: attention and MLP in parallel, bias-free LayerNorm, interleaved RoPE, logit_scale",
)

COHERE2 = Family(
    name="cohere2",
    architectures=("Cohere2ForCausalLM",),
    rotary_interleaved=True,
    parallel_block=True,
    refuse=_refuse_qk_norm,
    extra=_extra,
    read_config=_layer_types,
    windows=_windows,
    rope_layers=_rope_layers,
    notes="Command R7B / Command A: Cohere's layers, sliding-window layers with RoPE, full ones without",
)
