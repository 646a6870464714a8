"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: DeepSeek-V3, V3.1, R1, Moonlight and their bf16 re-releases): multi-latent
attention (MLA) and GLM-4.5's routing; DeepSeek-V2 (`DeepseekV2ForCausalLM`: V2-Lite, Coder-V2-Lite): the same
attention, softmax routing.

MLA (megatron-core's `MLASelfAttention` on the local spec): q from `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (one
`q_proj` when `q_lora_rank` is null); `kv_a_proj_with_mqa` gives a shared latent and one rotated key for every head,
the latent goes through `kv_a_layernorm` and `kv_b_proj` to each head's [k without RoPE; v]. Each head's q and k are
`qk_nope_head_dim` dims without RoPE then `qk_rope_head_dim` rotated ones; RoPE rotates adjacent pairs
(`rope_interleave`, which megatron's MLA always assumes: a config that turns it off is refused). YaRN scales only
the rotated dims (cos and sin times its attention factor) and the softmax by `mscale_all_dim`'s term, as
transformers does. The experts: `moe.sigmoid_experts` (V3), `moe.softmax_experts` (V2). V2's transformers code
rotates each adjacent pair as one complex number, the same rotation as V3's interleaved RoPE (V2 has no
`rope_interleave` field). LoRA: refused, as on every MoE family.
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.moe import sigmoid_experts, softmax_experts
from scalarlm.training.families.spec import Family, LatentAttention, rope_parameters

LATENT_LORA = ("LoRA on multi-head latent attention (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj) and on "
               "mixture-of-experts MLPs is not implemented")


def _latent_attention(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("rope_interleave") is False:
        raise InvalidRequest("rope_interleave=false is not supported (megatron's multi-latent attention rotates "
                             "adjacent pairs of the rope dims)", param="model")  # fmt: skip
    heads = int(config["num_attention_heads"])
    if int(config.get("num_key_value_heads") or heads) != heads:
        raise InvalidRequest(f"num_key_value_heads {config['num_key_value_heads']} must equal num_attention_heads "
                             f"{heads} for multi-latent attention", param="model")  # fmt: skip
    params, _ = rope_parameters(config)
    scaled = (params.get("rope_type") or "default") != "default"
    q_rank = config.get("q_lora_rank")
    mla = LatentAttention(
        q_rank=None if q_rank is None else int(q_rank),
        kv_rank=int(config["kv_lora_rank"]),
        nope_dim=int(config["qk_nope_head_dim"]),
        rope_dim=int(config["qk_rope_head_dim"]),
        v_dim=int(config["v_head_dim"]),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0) if scaled else 0.0,
    )
    return {"mla": mla, "head_dim": mla.nope_dim + mla.rope_dim}


def _v3_experts(config: dict[str, Any]) -> dict[str, Any]:
    routing = (config.get("scoring_func"), config.get("topk_method"))
    if routing != ("sigmoid", "noaux_tc"):
        # transformers' DeepSeek-V3 always routes so; vLLM reads these fields (softmax when absent)
        raise InvalidRequest(f"scoring_func {routing[0]!r} with topk_method {routing[1]!r}: DeepSeek-V3 routing is "
                             "scoring_func 'sigmoid' with topk_method 'noaux_tc' (as transformers runs it; vLLM reads "
                             "these fields and serves another routing without them)", param="model")  # fmt: skip
    return sigmoid_experts(config)


DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    rope_types=frozenset({"default", "yarn"}),
    extra=lambda config: {**_latent_attention(config), **_v3_experts(config)},
    lora_refusal=LATENT_LORA,
    notes="DeepSeek-V3: multi-latent attention (yarn on the rope dims), sigmoid-routed MoE with a fixed expert bias, "
          "group-limited top k and shared experts",
)

DEEPSEEK_V2 = Family(
    name="deepseek_v2",
    architectures=("DeepseekV2ForCausalLM",),
    rope_types=frozenset({"default", "yarn"}),
    extra=lambda config: {**_latent_attention(config), **softmax_experts(config)},
    lora_refusal=LATENT_LORA,
    notes="DeepSeek-V2: multi-latent attention (yarn on the rope dims), softmax-routed MoE (greedy or group-limited "
          "top k, not renormalised) with shared experts",
)
