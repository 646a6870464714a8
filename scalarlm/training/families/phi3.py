"""Phi-3 / Phi-4 (dense): Llama's shape with HF's fused `qkv_proj` ([q; k; v]) and `gate_up_proj` ([gate; up]).

`layouts.py` regroups qkv_proj per KV group for megatron's `linear_qkv`; gate_up_proj already is `linear_fc1`.
LoRA targets the fused modules (`qkv_proj`, `gate_up_proj`), as vLLM loads Phi-3 adapters. `longrope` scaling
(Phi-3.5-mini, Phi-4-mini, the 128k Phi-3 models) and partial RoPE (Phi-4-mini rotates 3/4 of each head) are read by
`spec.read_longrope` and applied by `model.rope_angles`. `resid_pdrop` is trained as transformers applies it (on the
attention's and the MLP's outputs, megatron's hidden dropout); `embd_pdrop`, which transformers' Phi-3 reads but never
applies, is not applied either.
"""

from __future__ import annotations

from typing import Any

from scalarlm.training.families.spec import Family, every_layer_window


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    return {"hidden_dropout": float(config.get("resid_pdrop") or 0.0)}


PHI3 = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    rope_types=frozenset({"default", "longrope"}),
    partial_rotary=1.0,
    fused_qkv=True,
    fused_gate_up=True,
    windows=every_layer_window,
    extra=_extra,
    notes="fused qkv_proj / gate_up_proj; longrope and partial RoPE",
)
