"""Nemotron (`NemotronForCausalLM`: NVIDIA's Nemotron-4 layout: Nemotron-Mini-4B-Instruct, Minitron-4B-Base,
Minitron-8B-Base, Nemotron-4 converted to HF): grouped-query attention with RoPE on the leading half
of each head (`partial_rotary_factor`, 0.5 when absent, as transformers assumes), LayerNorm with a zero-centred weight
(`layer_norm(x) * (1 + w) + b`, transformers' LayerNorm1P; `norm_eps`) before attention and the MLP and at the end, an
ungated ReLU-squared MLP (`up_proj`, `down_proj`), untied embeddings. LoRA targets q/k/v/o, `up_proj` and `down_proj`.
"""

from __future__ import annotations

from typing import Any

from scalarlm.training.families.spec import Family


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    return {"layer_norm": True, "norm_offset": True, "norm_eps": float(config.get("norm_eps") or 1e-5)}


NEMOTRON = Family(
    name="nemotron",
    architectures=("NemotronForCausalLM",),
    partial_rotary=0.5,
    fused_gate_up=True,  # one MLP input projection: up_proj
    mlp_names=("mlp", "up_proj", "down_proj"),
    gated_mlp=False,
    activations=frozenset({"relu2"}),
    extra=_extra,
    notes="Nemotron-4 / Minitron: LayerNorm1P, an ungated ReLU-squared MLP, RoPE on half of each head",
)
