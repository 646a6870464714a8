"""DeepSeek-V3 (multi-latent attention + sigmoid-routed experts) and DeepSeek-V2 (the same attention, softmax-routed
experts) without torch: what they read from the config, the MLA tensor rules, what they refuse (naming the field),
and the TP split they need."""

from __future__ import annotations

import pytest

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families import check_tensor_parallel, read_arch, rules
from scalarlm.training.families.spec import LatentAttention
from tests.unit.training.deepseek_configs import (
    DEEPSEEK_V2_GROUPS,
    DEEPSEEK_V2_LITE,
    DEEPSEEK_V3,
    deepseek_arch,
    deepseek_names,
)


def test_reads_the_latent_attention_shape_yarn_and_the_routing() -> None:
    arch = deepseek_arch(DEEPSEEK_V3)
    assert arch.family == "deepseek_v3"
    assert arch.mla == LatentAttention(q_rank=64, kv_rank=64, nope_dim=32, rope_dim=32, v_dim=32, mscale_all_dim=0.8)
    # q's head (no-RoPE dims then rotated ones), not HF's `head_dim` (the rope dims); RoPE over the rope dims only
    assert (arch.head_dim, arch.rotary_dim, arch.num_kv_heads, arch.rotary_interleaved) == (64, 32, 4, False)
    factor, _, _, original, attention, _ = arch.yarn_rope
    assert (factor, original) == (8.0, 128) and attention == pytest.approx((0.1 * 2.0794 + 1) / (0.08 * 2.0794 + 1),
                                                                           rel=1e-4)  # fmt: skip
    # YaRN's attention factor scales MLA's rotated dims (megatron's mscale), not the softmax (the no-RoPE dims keep
    # their scale)
    assert arch.attention_scale_factor(0) == 1.0
    assert (arch.num_experts, arch.moe_sigmoid, arch.moe_groups, arch.moe_scaling, arch.mtp_layers) == (
        4, True, (2, 1), 2.5, 1)  # fmt: skip
    assert arch.moe_layers == (False, True, True) and arch.moe_shared_name == "shared_experts"


def test_latent_attention_rules_map_every_projection_and_both_latent_norms() -> None:
    by_mcore = {r.mcore: r for r in rules(deepseek_arch(DEEPSEEK_V3))}
    attn, hf = "decoder.layers.1.self_attention.", "model.layers.1.self_attn."
    expected = {"linear_q_down_proj.weight": ("q_a_proj", "dim0"), "q_layernorm.weight": ("q_a_layernorm", "replicated"),
                "linear_q_up_proj.weight": ("q_b_proj", "dim0"),
                "linear_kv_down_proj.weight": ("kv_a_proj_with_mqa", "replicated"),
                "kv_layernorm.weight": ("kv_a_layernorm", "replicated"), "linear_kv_up_proj.weight": ("kv_b_proj", "dim0"),
                "linear_proj.weight": ("o_proj", "dim1")}  # fmt: skip
    for mcore, (name, kind) in expected.items():
        assert (by_mcore[attn + mcore].hf, by_mcore[attn + mcore].kind) == ((f"{hf}{name}.weight",), kind)
    assert not any("linear_qkv" in name for name in by_mcore)
    # DeepSeek-V2-Lite's layout: no q latent, one q_proj
    lite = {**DEEPSEEK_V3, "q_lora_rank": None}
    lite_rules = {r.mcore: r.hf for r in rules(deepseek_arch(lite))}
    assert lite_rules[attn + "linear_q_proj.weight"] == (hf + "q_proj.weight",)
    assert attn + "q_layernorm.weight" not in lite_rules and deepseek_arch(lite).mla.q_rank is None


def test_the_mtp_layer_is_skipped_and_missing_latent_tensors_refused() -> None:
    names = deepseek_names(DEEPSEEK_V3)
    read_arch(DEEPSEEK_V3, [*names, "model.layers.3.eh_proj.weight", "model.layers.3.self_attn.q_a_proj.weight"])
    with pytest.raises(InvalidRequest, match=r"lacks 1 tensor.*kv_a_layernorm"):
        read_arch(DEEPSEEK_V3, [n for n in names if n != "model.layers.2.self_attn.kv_a_layernorm.weight"])


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_interleave": False}, "rope_interleave=false is not supported"),
    ({"num_key_value_heads": 2}, "num_key_value_heads 2 must equal num_attention_heads 4"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' with topk_method 'noaux_tc'"),
    ({"topk_method": None}, "scoring_func 'sigmoid' with topk_method None"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported for deepseek_v3"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, r"quantized \(quantization_config: fp8\).*"
                                                                       "dequantize it first"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},  # V3's own release
     r"quantized \(quantization_config: fp8\).*dequantize it first \(`scalarlm dequantize DIR -o OUT`"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
])  # fmt: skip
def test_refusals_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        read_arch({**DEEPSEEK_V3, **change}, deepseek_names(DEEPSEEK_V3))


def test_deepseek_v2_reads_the_same_attention_and_softmax_routing() -> None:
    arch = deepseek_arch(DEEPSEEK_V2_LITE)
    assert arch.family == "deepseek_v2"
    assert arch.mla == LatentAttention(q_rank=None, kv_rank=64, nope_dim=32, rope_dim=32, v_dim=32,
                                       mscale_all_dim=0.707)  # fmt: skip
    assert (arch.head_dim, arch.rotary_dim, arch.attention_scale_factor(0)) == (64, 32, 1.0)
    # mscale = mscale_all_dim: no factor on the rotated dims (the softmax's mscale_all_dim term stays, megatron's)
    assert arch.yarn_rope[4] == pytest.approx(1.0)
    # softmax over every expert, then the top k, not renormalised (megatron's pre-softmax), no expert bias
    assert (arch.num_experts, arch.moe_topk, arch.moe_norm_topk, arch.moe_sigmoid) == (4, 2, False, False)
    assert (arch.moe_groups, arch.moe_scaling, arch.mtp_layers) == ((1, 1), 1.0, 0)
    assert arch.moe_shared_ffn_hidden_size == 2 * 128 and arch.moe_layers == (False, True, True)
    assert not any("e_score_correction_bias" in name for name in deepseek_names(DEEPSEEK_V2_LITE))
    grouped = deepseek_arch(DEEPSEEK_V2_GROUPS)
    assert (grouped.moe_groups, grouped.moe_topk, grouped.moe_scaling) == ((4, 2), 3, 16.0)
    # greedy with every group kept is greedy (V2-Lite's hub config says n_group 1, topk_group 1)
    assert deepseek_arch({**DEEPSEEK_V2_LITE, "n_group": 2, "topk_group": 2}).moe_groups == (1, 1)


@pytest.mark.parametrize(("change", "message"), [
    ({"norm_topk_prob": True}, "norm_topk_prob=true is not supported for DeepSeek-V2"),
    ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' with topk_method 'greedy'"),
    ({"topk_method": "noaux_tc"}, "scoring_func 'softmax' with topk_method 'noaux_tc'"),
    # transformers ignores the groups under `greedy`, vLLM limits them
    ({"n_group": 2, "topk_group": 1}, "topk_method 'greedy' with n_group=2, topk_group=1"),
    # DeepSeek-V2 / V2.5's own routing (6 of 160 experts, 3 of 8 groups): megatron ranks a group by its top 2
    ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
     r"num_experts_per_tok // topk_group = 1 \(transformers ranks a group by its best score"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported for deepseek_v2"),
])  # fmt: skip
def test_deepseek_v2_refusals_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        read_arch({**DEEPSEEK_V2_LITE, **change}, deepseek_names(DEEPSEEK_V2_LITE))


def test_tensor_parallel_splits_the_q_latent_not_the_kv_one() -> None:
    check_tensor_parallel(deepseek_arch(DEEPSEEK_V3), 2)
    check_tensor_parallel(deepseek_arch({**DEEPSEEK_V3, "kv_lora_rank": 63}), 2)  # the kv down projection stays whole
    with pytest.raises(InvalidRequest, match=r"q_lora_rank \(63\)"):  # q's splits by rows
        check_tensor_parallel(deepseek_arch({**DEEPSEEK_V3, "q_lora_rank": 63}), 2)
