"""Mixture-of-experts families: Qwen3-MoE (`Qwen3MoeForCausalLM`), Qwen2-MoE (`Qwen2MoeForCausalLM`), Mixtral
(`MixtralForCausalLM`) and OLMoE (`OlmoeForCausalLM`).

Each is its dense sibling (Qwen3: per-head q/k norms; Qwen2: q/k/v biases; Mistral: optional `sliding_window` on
every layer) with the
MLP replaced, on the sparse layers, by megatron-core's `MoELayer` on the local spec: a top-k router computed in fp32
and `SequentialMLP` experts (one SwiGLU MLP each). HF's router (`gate`) -> `mlp.router`, each expert's gate/up ->
`mlp.experts.local_experts.{e}.linear_fc1` as [gate; up], down -> `linear_fc2`; publish writes the hub's per-expert
layout back (what `transformers` and vLLM load).

Routing as HF computes it: softmax over all experts, the top k, renormalised to sum 1 when `norm_topk_prob`
(Mixtral: always). megatron's `moe_router_pre_softmax=False` (top k of the logits, softmax over those k) is exactly
the renormalised case; `True` (softmax first, top k) the other. Qwen3-MoE's dense layers (`mlp_only_layers`,
`decoder_sparse_step`) keep the dense MLP of size `intermediate_size`, as do Qwen2-MoE's. Qwen2-MoE adds a shared
expert to every sparse layer (megatron's `SharedExpertMLP` with its sigmoid gate: `shared_expert.*` ->
`mlp.shared_experts.linear_fc1/fc2`, `shared_expert_gate` -> `mlp.shared_experts.gate_weight`).

OLMoE is Llama's attention with OLMo 2's q/k RMSNorms over the whole projection (before RoPE) and every layer sparse,
softmax routing not renormalised (`norm_topk_prob`, false in the released models).

Refused: Mixtral's `router_jitter_noise` (HF scales the hidden states fed to router and experts, megatron's jitter
only the router's input), shared experts on Qwen3-MoE, and LoRA (no per-expert adapter rule yet). The load-balancing
loss is off unless the train arg `moe_aux_loss_coef` is set (HF: unless `output_router_logits`); its value is always
in the metrics (`training/moe_balance.py`).
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family, every_layer_window, layer_type_windows

# LoRA on a mixture-of-experts model adapts its attention; an adapter on its MLPs is refused by name.
EXPERT_LORA = (("gate_proj", "up_proj", "down_proj"),
               "adapters on a mixture-of-experts model's MLPs (routed and shared experts, dense layers) are not "
               "implemented: target its attention (q_proj, k_proj, v_proj, o_proj; a Tinker LoRA client: "
               "train_mlp=False)")


def top_k_experts(config: dict[str, Any], norm_topk: bool) -> dict[str, Any]:
    """`num_experts` (or `num_local_experts`) routed experts, `num_experts_per_tok` of them per token, the top k
    renormalised when `norm_topk`."""
    # The hub's Qwen3-MoE configs say `num_experts`; transformers 5 saves it as `num_local_experts` (Mixtral's name).
    count_field = "num_experts" if config.get("num_experts") is not None else "num_local_experts"
    experts = int(config.get(count_field) or 0)
    topk = int(config.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= topk <= experts:
        raise InvalidRequest(f"{count_field}={experts} with num_experts_per_tok={topk} is not a top-k "
                             "mixture of experts", param="model")  # fmt: skip
    return {"num_experts": experts, "moe_topk": topk, "moe_norm_topk": norm_topk}


def _qwen_moe(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE's and Qwen3-MoE's experts: sparse layers from `decoder_sparse_step` and `mlp_only_layers`, routing
    renormalised when `norm_topk_prob`."""
    layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    if not dense <= set(range(layers)):
        raise InvalidRequest(f"mlp_only_layers {sorted(dense)} name layers the model does not have", param="model")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return {
        **top_k_experts(config, bool(config.get("norm_topk_prob"))),
        "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
        "moe_layers": () if all(sparse) else sparse,
        "expert_names": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    }


def _qwen3_moe(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("shared_expert_intermediate_size"):
        raise InvalidRequest("shared experts are not supported for qwen3_moe (Qwen2-MoE's are)", param="model")
    return _qwen_moe(config)


def _qwen2_moe(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE: Qwen3-MoE's routing plus a gated shared expert on every sparse layer."""
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    return {**_qwen_moe(config), "moe_shared_ffn_hidden_size": shared, "moe_shared_gate": shared > 0}


def _mixtral(config: dict[str, Any]) -> dict[str, Any]:
    if float(config.get("router_jitter_noise") or 0.0):
        raise InvalidRequest(f"router_jitter_noise={config['router_jitter_noise']} is not supported "
                             "(megatron jitters only the router's input, HF the experts' too)", param="model")  # fmt: skip
    return {
        **top_k_experts(config, True),
        "moe_ffn_hidden_size": int(config["intermediate_size"]),
        "expert_names": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
    }


def _olmoe(config: dict[str, Any]) -> dict[str, Any]:
    """OLMoE: every layer sparse (each expert `intermediate_size` wide), HF's routing; what vLLM would serve otherwise
    refused."""
    if config.get("clip_qkv") is not None:
        raise InvalidRequest(f"clip_qkv={config['clip_qkv']} is not supported (transformers clamps q, k and v; vLLM "
                             "0.32.0's OLMoE does not)", param="model")  # fmt: skip
    eps = float(config.get("rms_norm_eps") or 1e-5)
    if eps != 1e-5:
        raise InvalidRequest(f"rms_norm_eps={eps} is not supported for olmoe: vLLM 0.32.0's OLMoE normalises q and k "
                             "with eps 1e-5 whatever the config says (the released models' value)",
                             param="model")  # fmt: skip
    return {
        **top_k_experts(config, bool(config.get("norm_topk_prob"))),
        "moe_ffn_hidden_size": int(config["intermediate_size"]),
        "expert_names": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    }


def _deepseek_experts(config: dict[str, Any], group_rank: int, ranked: str) -> dict[str, Any]:
    """What DeepSeek-V2's, DeepSeek-V3's and GLM-4.5's experts share: `n_routed_experts`, group-limited top k (a
    group ranked by its top `group_rank` scores in transformers, by its top k / `topk_group` in megatron: the two
    agree only when that quotient is `group_rank`), dense layers below `first_k_dense_replace`,
    `routed_scaling_factor`, an ungated shared expert (`n_shared_experts` x the expert size), and the
    multi-token-prediction layers after the last one (skipped)."""
    experts, topk = int(config.get("n_routed_experts") or 0), int(config.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= topk <= experts:
        raise InvalidRequest(f"n_routed_experts={experts} with num_experts_per_tok={topk} is not a top-k mixture of "
                             "experts", param="model")  # fmt: skip
    groups, kept = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    if groups > 1 and (experts % groups or not 1 <= kept <= groups or topk // kept != group_rank):
        raise InvalidRequest(f"n_group={groups}, topk_group={kept} with num_experts_per_tok={topk}: group-limited "
                             f"routing needs n_group to divide the experts and num_experts_per_tok // topk_group = "
                             f"{group_rank} ({ranked}; megatron ranks it by its top num_experts_per_tok // "
                             "topk_group)", param="model")  # fmt: skip
    if int(config.get("moe_layer_freq") or 1) != 1:
        raise InvalidRequest(f"moe_layer_freq={config['moe_layer_freq']} is not supported (every layer from "
                             "first_k_dense_replace on is sparse)", param="model")  # fmt: skip
    layers, dense = int(config["num_hidden_layers"]), int(config.get("first_k_dense_replace", 1) or 0)
    size = int(config["moe_intermediate_size"])
    return {
        "num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": size,
        "moe_layers": () if dense == 0 else tuple(i >= dense for i in range(layers)),
        "expert_names": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
        "moe_shared_ffn_hidden_size": size * int(config.get("n_shared_experts") or 0),
        "moe_shared_name": "shared_experts", "moe_groups": (groups, kept),
        "moe_scaling": float(config.get("routed_scaling_factor") or 1.0),
        "mtp_layers": int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0),
    }  # fmt: skip


def sigmoid_experts(config: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's and DeepSeek-V3's experts (`_deepseek_experts`): sigmoid routing with the fixed expert bias, the
    chosen scores renormalised."""
    if config.get("norm_topk_prob") is False:
        raise InvalidRequest("norm_topk_prob=false with sigmoid routing is not supported (megatron renormalises the "
                             "chosen scores)", param="model")  # fmt: skip
    ranked = "transformers ranks a group by its top 2 scores"
    return {**_deepseek_experts(config, 2, ranked), "moe_norm_topk": True, "moe_sigmoid": True}


def softmax_experts(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's experts (`_deepseek_experts`): softmax over every expert, then the top k (`topk_method`
    `greedy`, or `group_limited_greedy`: a group ranked by its best score), never renormalised (transformers does
    not read `norm_topk_prob`; vLLM does, so it must be false); megatron's `moe_router_pre_softmax`."""
    scoring, method = config.get("scoring_func") or "softmax", config.get("topk_method") or "greedy"
    if scoring != "softmax" or method not in ("greedy", "group_limited_greedy"):
        raise InvalidRequest(f"scoring_func {scoring!r} with topk_method {method!r}: DeepSeek-V2 routes by softmax "
                             "with topk_method 'greedy' or 'group_limited_greedy' (as transformers runs it)",
                             param="model")  # fmt: skip
    if config.get("norm_topk_prob"):
        raise InvalidRequest("norm_topk_prob=true is not supported for DeepSeek-V2 (transformers never renormalises "
                             "the chosen scores, vLLM would)", param="model")  # fmt: skip
    groups, kept = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    if method == "greedy":
        if kept < groups:  # vLLM limits the groups whatever the method says
            raise InvalidRequest(f"topk_method 'greedy' with n_group={groups}, topk_group={kept}: transformers "
                                 "ignores the groups, vLLM does not; set topk_group = n_group or use "
                                 "'group_limited_greedy'", param="model")  # fmt: skip
        config = {**config, "n_group": 1, "topk_group": 1}
    ranked = "transformers ranks a group by its best score"
    return {**_deepseek_experts(config, 1, ranked), "moe_norm_topk": False, "moe_sigmoid": False}


def _glm4_moe(config: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5: `sigmoid_experts`, and per-head q/k RMSNorms before RoPE when `use_qk_norm` (as Qwen3's)."""
    return {**sigmoid_experts(config), "qk_layernorm": bool(config.get("use_qk_norm"))}


QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    qk_layernorm=True,
    rope_types=frozenset({"default", "yarn"}),
    windows=lambda config, layers: layer_type_windows(config, layers, bool(config.get("use_sliding_window"))),
    extra=_qwen3_moe,
    lora_excluded=EXPERT_LORA,
    notes="Qwen3 + top-k MoE (norm_topk_prob, decoder_sparse_step, mlp_only_layers)",
)

QWEN2_MOE = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    qkv_bias_from_weights=True,
    rope_types=frozenset({"default", "yarn"}),
    windows=lambda config, layers: layer_type_windows(config, layers, bool(config.get("use_sliding_window"))),
    extra=_qwen2_moe,
    lora_excluded=EXPERT_LORA,
    notes="Qwen2 attention (q/k/v biases) + top-k MoE with a sigmoid-gated shared expert",
)

GLM4_MOE = Family(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    partial_rotary=0.5,
    qkv_bias_from_weights=True,
    extra=_glm4_moe,
    lora_excluded=EXPERT_LORA,
    notes="GLM-4.5: partial RoPE, q/k/v biases, sigmoid-routed MoE with a fixed expert bias and a shared expert",
)

OLMOE = Family(
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    qk_norm_over_projection=True,
    extra=_olmoe,
    lora_excluded=EXPERT_LORA,
    notes="OLMoE: Llama attention with q/k RMSNorm over the whole projection + top-k MoE on every layer",
)

MIXTRAL = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    windows=every_layer_window,
    extra=_mixtral,
    lora_excluded=EXPERT_LORA,
    notes="Mistral + top-k MoE (block_sparse_moe, w1/w3/w2 experts)",
)
