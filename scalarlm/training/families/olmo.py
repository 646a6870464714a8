"""OLMo 2 (`Olmo2ForCausalLM`) and OLMo 3 (`Olmo3ForCausalLM`), AI2's open models: Llama's attention, SwiGLU and
RoPE with the norms moved. No norm before attention or the MLP; an RMSNorm on each block's output before the residual
add (HF's `post_attention_layernorm` and `post_feedforward_layernorm`); q and k RMS-normalised over the whole
projection (all heads at once, weights of width heads x head_dim), before RoPE. OLMo 3 adds sliding-window attention
on the `layer_types` layers (3 of every 4 in the released models), with a RoPE base per layer type, and the
released checkpoints extend the full-attention layers' context with `yarn` RoPE scaling (the sliding layers keep
plain RoPE).
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family, layer_type_windows, read_yarn


DEFAULT_THETA = 500000.0  # transformers' Olmo3Config.default_theta
OLMO3_SLIDING_WINDOW = 4096  # transformers' default when the config has no `sliding_window`
LAYER_TYPES = ("full_attention", "sliding_attention")


def _olmo3_rope_parameters(config: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], str]:
    """Each layer type's RoPE parameters, as transformers' Olmo3Config reads them: transformers 5 writes one entry per
    layer type; a 4.x config's `rope_scaling` applies to the full-attention layers, with `rope_theta`, while the
    sliding layers keep the default type and base (transformers consumes `rope_theta` for the full layers only)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(params.get(t), dict) for t in LAYER_TYPES):
        return {t: {"rope_type": "default", "rope_theta": DEFAULT_THETA, **(params.get(t) or {})}
                for t in LAYER_TYPES}, "rope_parameters"  # fmt: skip
    full = {"rope_type": "default", **(config.get("rope_scaling") or {})}
    full["rope_theta"] = config.get("rope_theta") or DEFAULT_THETA
    return {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": DEFAULT_THETA}}, \
        "rope_scaling"  # fmt: skip


def _olmo3_extra(config: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3's RoPE: plain on the sliding layers (their base becomes `local_rope_theta` when the full layers' base
    or scaling differs), plain or `yarn` (the released checkpoints' 65K context) on the full-attention layers."""
    per_type, where = _olmo3_rope_parameters(config)
    kinds = {t: per_type[t].get("rope_type") or per_type[t].get("type") or "default" for t in LAYER_TYPES}
    if kinds["sliding_attention"] != "default":
        raise InvalidRequest(f"{where}.sliding_attention.rope_type {kinds['sliding_attention']!r}: RoPE scaling on "
                             "the sliding layers is not supported", param="model")  # fmt: skip
    full_where = f"{where}.full_attention" if where == "rope_parameters" else where
    if kinds["full_attention"] not in ("default", "yarn"):
        raise InvalidRequest(f"{full_where}.rope_type {kinds['full_attention']!r} is not supported for olmo3 "
                             "(supported: ['default', 'yarn'])", param="model")  # fmt: skip
    theta, local = (float(per_type[t]["rope_theta"]) for t in LAYER_TYPES)
    yarn = None
    if kinds["full_attention"] == "yarn":
        top = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
        yarn = read_yarn(per_type["full_attention"], full_where, int(config.get("max_position_embeddings") or 2048),
                         bool(top.get("truncate", True)))  # fmt: skip
    if (yarn or local != theta) and "sliding_window" in config and config["sliding_window"] is None:
        # transformers still rotates the sliding-type layers with their own RoPE; our per-layer RoPE follows windows
        raise InvalidRequest("sliding_window null with a RoPE that differs per layer type is not supported",
                             param="model")  # fmt: skip
    return {"rope_theta": theta, "yarn_rope": yarn, "local_rope_theta": local if yarn or local != theta else None}


def _olmo3_windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """`layer_types` (when absent, as transformers derives it: every 4th layer full, the rest sliding) with
    `sliding_window` (4096 when absent)."""
    types = config.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                          for i in range(layers)]  # fmt: skip
    window = config["sliding_window"] if "sliding_window" in config else OLMO3_SLIDING_WINDOW
    return layer_type_windows({**config, "layer_types": types, "sliding_window": window}, layers, True)


_OLMO = dict(input_norms=False, sandwich_norms=True, qk_norm_over_projection=True)

OLMO2 = Family(
    name="olmo2",
    architectures=("Olmo2ForCausalLM",),
    **_OLMO,
    notes="OLMo 2: output norms only, q/k RMSNorm over the whole projection",
)

OLMO3 = Family(
    name="olmo3",
    architectures=("Olmo3ForCausalLM",),
    **_OLMO,
    windows=_olmo3_windows,
    extra=_olmo3_extra,
    notes="OLMo 3: OLMo 2's norms, sliding windows on the layer_types layers, YaRN on the full-attention layers",
)
