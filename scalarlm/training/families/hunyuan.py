"""HunYuan dense (`HunYuanDenseV1ForCausalLM`: Tencent's Hunyuan-0.5B/1.8B/4B/7B, base and instruct, Hunyuan-MT-7B):
Llama's layers with per-head q/k RMSNorms (`query_layernorm`, `key_layernorm`) applied after RoPE, and `dynamic` RoPE
with Hunyuan's NTK `alpha`: a fixed base of rope_theta * alpha ** (d / (d - 2)), as transformers computes it. Past
`max_position_embeddings` transformers recomputes that RoPE for the longer sequence, so `max_seq_len` is capped there.
Refused: `use_cla` (cross-layer attention), `use_qk_norm` or `use_rotary_pos_emb` false, a `norm_type` other than rms
(fields of the original code that transformers does not implement), partial RoPE.
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family, rope_parameters


def _refuse(config: dict[str, Any]) -> None:
    for name, wrong in (("use_cla", True), ("use_qk_norm", False), ("use_rotary_pos_emb", False)):
        if config.get(name) is wrong:
            raise InvalidRequest(f"{name}={str(wrong).lower()} is not supported for hunyuan", param="model")
    params, _ = rope_parameters(config)
    if float(params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0) != 1.0:
        raise InvalidRequest("partial_rotary_factor (partial RoPE) is not supported for hunyuan", param="model")
    if config.get("norm_type", "rms") != "rms":
        raise InvalidRequest(f"norm_type {config['norm_type']!r} is not supported for hunyuan (rms only)",
                             param="model")  # fmt: skip


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    params, where = rope_parameters(config)
    rope_type = params.get("rope_type") or "default"
    if rope_type not in ("default", "dynamic"):
        raise InvalidRequest(f"{where}.rope_type {rope_type!r} is not supported for hunyuan (supported: default, "
                             "dynamic)", param="model")  # fmt: skip
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    alpha = params.get("alpha") if rope_type == "dynamic" else None
    if alpha:
        theta *= float(alpha) ** (head_dim / (head_dim - 2))
    limit = int(config.get("max_position_embeddings") or 2048) if rope_type == "dynamic" else None
    return {"rope_theta": theta, "rope_max_positions": limit}


HUNYUAN = Family(
    name="hunyuan",
    architectures=("HunYuanDenseV1ForCausalLM",),
    qk_layernorm=True,
    qk_norm_names=("query_layernorm", "key_layernorm"),
    qk_norm_after_rope=True,
    refuse=_refuse,
    extra=_extra,
    notes="HunYuan dense: q/k norms after RoPE, dynamic RoPE with NTK alpha",
)
