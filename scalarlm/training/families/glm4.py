"""GLM-4 (`Glm4ForCausalLM`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): Llama's layers with GLM's differences.

RoPE on the leading half of each head (`partial_rotary_factor`, 0.5 when the config has none, as transformers and
vLLM assume) rotating adjacent pairs of dims (GPT-J style: megatron's `rotary_interleaved`); q/k/v biases
(`attention_bias`, none on o_proj); HF's fused `gate_up_proj` ([gate; up]); an RMSNorm on attention's and on the MLP's
output before each residual add, beside the usual input norms (HF: `post_self_attn_layernorm`, then
`post_attention_layernorm` before the MLP, `post_mlp_layernorm`). LoRA leaves the fused MLP input projection out:
vLLM 0.32 expects a GLM-4 adapter's MLP modules split (gate_proj / up_proj), which transformers' GLM-4 and so PEFT
do not have.
"""

from __future__ import annotations

from scalarlm.training.families.spec import Family

GLM4 = Family(
    name="glm4",
    architectures=("Glm4ForCausalLM",),
    partial_rotary=0.5,
    rotary_interleaved=True,
    qkv_bias_from_weights=True,
    fused_gate_up=True,
    sandwich_norms=True,
    norm_names=("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
    lora_unservable=(("gate_up_proj",), "vLLM 0.32 loads GLM-4 adapters only on separate gate_proj / up_proj modules, "
                                        "which GLM-4 does not have (it fuses them into gate_up_proj)"),
    notes="interleaved partial RoPE, q/k/v biases, fused gate_up_proj, output norms after attention and the MLP",
)
