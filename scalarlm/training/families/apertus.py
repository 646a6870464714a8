"""Apertus (`ApertusForCausalLM`: the Swiss AI Apertus-8B and -70B, base and instruct): Llama's attention with per-head
q/k RMSNorms before RoPE (Qwen3's), `llama3` RoPE scaling, its norms before attention and the MLP named
`attention_layernorm` and `feedforward_layernorm`, and an ungated MLP (`up_proj`, `down_proj`) with xIELU, whose two
scalars per layer (`act_fn.alpha_p`, `act_fn.alpha_n`) train with the weights (`act_fn.beta`, `act_fn.eps` stay).
LoRA targets q/k/v/o, `up_proj` and `down_proj`. A config without its RoPE fields is refused (transformers would assume
llama3 scaling of base 1.2e7 there).
"""

from __future__ import annotations

from functools import partial

from scalarlm.training.families.spec import Family, refuse_without_rope

APERTUS = Family(
    name="apertus",
    architectures=("ApertusForCausalLM",),
    rope_types=frozenset({"default", "llama3"}),
    qk_layernorm=True,
    input_norm_names=("attention_layernorm", "feedforward_layernorm"),
    fused_gate_up=True,  # one MLP input projection: up_proj
    mlp_names=("mlp", "up_proj", "down_proj"),
    gated_mlp=False,
    activations=frozenset({"xielu"}),
    refuse=partial(refuse_without_rope, family="apertus", assumed="llama3 scaling of base 1.2e7"),
    notes="Apertus: Llama with q/k norms, an ungated xIELU MLP (learned per layer), llama3 RoPE",
)
