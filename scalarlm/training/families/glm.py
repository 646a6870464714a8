"""GLM-4 (`GlmForCausalLM`: glm-4-9b-chat-hf) and GLM-4-0414 (`Glm4ForCausalLM`: GLM-4-9B/32B-0414, GLM-Z1): Llama's
layers with GLM's differences.

Both: RoPE on the leading half of each head (`partial_rotary_factor`, 0.5 when the config has none, as transformers
and vLLM assume) rotating adjacent pairs of dims (GPT-J style: megatron's `rotary_interleaved`); q/k/v biases
(`attention_bias`, none on o_proj); HF's fused `gate_up_proj` ([gate; up]). GLM-4-0414 adds an RMSNorm on attention's
and on the MLP's output before each residual add (HF: `post_self_attn_layernorm`, then `post_attention_layernorm`
before the MLP, `post_mlp_layernorm`), and its LoRA leaves the fused MLP input projection out: vLLM 0.32's native
GLM-4-0414 expects an adapter's MLP modules split (gate_proj / up_proj), which transformers' model and so PEFT do not
have. vLLM serves `GlmForCausalLM` through its Transformers backend, which takes the fused module.
"""

from __future__ import annotations

from scalarlm.training.families.spec import Family

_GLM = dict(partial_rotary=0.5, rotary_interleaved=True, qkv_bias_from_weights=True, fused_gate_up=True)

GLM = Family(
    name="glm",
    architectures=("GlmForCausalLM",),
    **_GLM,
    notes="interleaved partial RoPE, q/k/v biases, fused gate_up_proj",
)

GLM4 = Family(
    name="glm4",
    architectures=("Glm4ForCausalLM",),
    **_GLM,
    sandwich_norms=True,
    norm_names=("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
    lora_excluded=(("gate_up_proj",), "vLLM 0.32 loads GLM-4-0414 adapters only on separate gate_proj / up_proj "
                                      "modules, which the model does not have (it fuses them into gate_up_proj)"),
    notes="GLM's layers plus output norms after attention and the MLP",
)
