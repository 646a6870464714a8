"""HunYuan dense (`HunYuanDenseV1ForCausalLM`: Tencent's Hunyuan-0.5B/1.8B/4B/7B, base and instruct, Hunyuan-MT-7B):
Llama's layers with per-head q/k RMSNorms (`query_layernorm`, `key_layernorm`) applied after RoPE, and `dynamic` RoPE
with Hunyuan's NTK `alpha`: a fixed base of rope_theta * alpha ** (d / (d - 2)), as transformers computes it (the
common RoPE reader). Past `max_position_embeddings` transformers recomputes that RoPE for the longer sequence, so
`max_seq_len` is capped there. Refused: `use_cla` (cross-layer attention), `use_qk_norm` or `use_rotary_pos_emb` false,
a `norm_type` other than rms (fields of the original code that transformers does not implement).
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family


def _refuse(config: dict[str, Any]) -> None:
    for name, wrong in (("use_cla", True), ("use_qk_norm", False), ("use_rotary_pos_emb", False)):
        if config.get(name) is wrong:
            raise InvalidRequest(f"{name}={str(wrong).lower()} is not supported for hunyuan", param="model")
    if config.get("norm_type", "rms") != "rms":
        raise InvalidRequest(f"norm_type {config['norm_type']!r} is not supported for hunyuan (rms only)",
                             param="model")  # fmt: skip


HUNYUAN = Family(
    name="hunyuan",
    architectures=("HunYuanDenseV1ForCausalLM",),
    rope_types=frozenset({"default", "dynamic"}),
    qk_layernorm=True,
    qk_norm_names=("query_layernorm", "key_layernorm"),
    qk_norm_after_rope=True,
    refuse=_refuse,
    notes="HunYuan dense: q/k norms after RoPE, dynamic RoPE with NTK alpha",
)
