"""Arcee (`ArceeForCausalLM`: Arcee AI's AFM-4.5B, base and instruct): Llama's attention and norms with an ungated MLP,
`down_proj(relu(up_proj(x)) ** 2)` (ReLU squared, `hidden_act` relu2; megatron's squared_relu with its
gated_linear_unit off), `yarn` RoPE scaling (AFM-4.5B's long context). LoRA targets q/k/v/o, `up_proj` and
`down_proj` (the default targets' `gate_proj` does not exist here and is left out).
"""

from __future__ import annotations

from scalarlm.training.families.spec import Family

ARCEE = Family(
    name="arcee",
    architectures=("ArceeForCausalLM",),
    rope_types=frozenset({"default", "yarn"}),
    fused_gate_up=True,  # one MLP input projection: up_proj
    mlp_names=("mlp", "up_proj", "down_proj"),
    gated_mlp=False,
    activations=frozenset({"relu2"}),
    notes="Arcee (AFM): Llama with an ungated ReLU-squared MLP; yarn RoPE",
)
