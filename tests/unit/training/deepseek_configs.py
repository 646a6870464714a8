"""DeepSeek-V3 and DeepSeek-V2 config fields scaled down, and the arch the trainer reads from them (the tensor names
exactly what the family's rules map), shared by the DeepSeek family, RoPE and routing tests."""

from __future__ import annotations

from scalarlm.training.families import BY_NAME, hf_tensor_names, read_arch
from scalarlm.training.families.spec import ModelArch

# DeepSeek-V3's fields, scaled down (V3: 128 heads, q/kv latents 1536/512, 128 + 64 q/k dims, v 128, yarn 40 x 4K).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "hidden_act": "silu", "q_lora_rank": 64, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "head_dim": 32, "rope_interleave": True,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 1024, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
}  # fmt: skip
# DeepSeek-V2-Lite's fields, scaled down (V2-Lite: 16 heads, no q latent, kv latent 512, 128 + 64 q/k dims, 64 experts,
# 6 per token, greedy softmax routing not renormalised, 2 shared experts, yarn 40 x 4K with mscale = mscale_all_dim).
DEEPSEEK_V2_LITE = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k not in ("num_nextn_predict_layers", "rope_interleave")},
    "architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": None, "n_shared_experts": 2, "n_group": 1,
    "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False, "scoring_func": "softmax",
    "topk_method": "greedy", "moe_layer_freq": 1,
    "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
}  # fmt: skip
# DeepSeek-V2's group-limited routing where megatron's group rank equals transformers' (k / topk_group = 1).
DEEPSEEK_V2_GROUPS = {**DEEPSEEK_V2_LITE, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
                      "topk_group": 2, "topk_method": "group_limited_greedy", "routed_scaling_factor": 16.0}


def deepseek_names(config: dict) -> list[str]:
    """Exactly the tensor names the rules of `config`'s shape map."""
    family = "deepseek_v2" if config["architectures"] == ["DeepseekV2ForCausalLM"] else "deepseek_v3"
    first = BY_NAME[family].extra(config)
    probe = ModelArch(family="probe", vocab_size=1, hidden_size=1, num_layers=config["num_hidden_layers"],
                      num_heads=1, num_kv_heads=1, ffn_hidden_size=1, norm_eps=0.0, rope_theta=0.0,
                      max_position_embeddings=1, tied_embeddings=False, **first)  # fmt: skip
    return hf_tensor_names(probe)


def deepseek_arch(config: dict) -> ModelArch:
    return read_arch(config, deepseek_names(config))
