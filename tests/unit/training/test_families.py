"""The family rules, without torch: which config fields each family reads, and what it refuses naming the field."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import ALL_LINEAR, DEFAULT_TARGETS
from scalarlm.training.families import BY_NAME, FAMILIES, FAMILY_LIST, REFUSED, hf_tensor_names, read_arch
from scalarlm.training.families.spec import ACTIVATIONS, ModelArch, lora_targets, rules

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


def arch_of(architecture: str = "LlamaForCausalLM", **changes) -> ModelArch:
    """Read a config whose tensor names are exactly what its family maps (so only the config is under test)."""
    config = {**BASE, "architectures": [architecture], **changes}
    probe = read_arch(config, _names_for(config))
    return probe


def _names_for(config: dict) -> list[str]:
    family = FAMILIES.get(config["architectures"][0], BY_NAME["llama"])
    config = family.read_config(config)
    model_names = family.text_inside[0].model_names if family.text_inside else family.model_names
    tied = bool(config.get("tie_word_embeddings"))
    extra = family.extra(config)  # StarCoder2: its norms' and linears' biases
    shape = ModelArch(family=family.name, vocab_size=1, hidden_size=1, num_layers=config["num_hidden_layers"],
                      num_heads=1, num_kv_heads=1, head_dim=1, ffn_hidden_size=1, norm_eps=0.0, rope_theta=0.0,
                      max_position_embeddings=1, tied_embeddings=tied, qk_layernorm=family.qk_layernorm,
                      fused_qkv=family.fused_qkv, fused_gate_up=family.fused_gate_up, mlp_names=family.mlp_names,
                      gated_mlp=family.gated_mlp, input_norm_names=family.input_norm_names,
                      qk_norm_names=family.qk_norm_names, qk_norm_after_rope=family.qk_norm_after_rope,
                      activation=ACTIVATIONS.get(config.get("hidden_act"), "silu"),  # Apertus: xIELU's scalars
                      sandwich_norms=family.sandwich_norms, input_norms=family.input_norms,
                      qk_norm_over_projection=family.qk_norm_over_projection, norm_names=family.norm_names,
                      parallel_block=extra.pop("parallel_block", family.parallel_block),
                      qkv_grouped=family.qkv_grouped,
                      attention_names=family.attention_names, model_names=model_names,
                      qkv_bias=family.qkv_bias_from_weights and any(config.get(k) for k in (
                          "attention_bias", "use_bias", "use_qkv_bias")),
                      **{k: v for k, v in extra.items() if k in ("layer_norm", "norm_bias", "linear_bias",
                                                                 "parallel_mlp_norm", "output_bias",
                                                                 "qk_norm_per_head")})  # fmt: skip
    return hf_tensor_names(shape)


def test_family_modules_import_no_torch() -> None:
    code = ("import sys, scalarlm.training.families, scalarlm.launcher.model_check; "
            "sys.exit(any(m.split('.')[0] in ('torch', 'transformers', 'megatron') for m in sys.modules))")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_registry_names_every_family_once() -> None:
    assert {f.name for f in FAMILY_LIST} == {"llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma",
                                            "gemma2", "gemma3", "olmo2", "olmo3", "qwen3_moe", "qwen2_moe", "mixtral",
                                            "granite", "glm", "glm4", "glm4_moe", "deepseek_v3",
                                            "deepseek_v2", "olmoe", "exaone4", "ernie4_5", "granite4",
                                            "granitemoe", "gpt_oss", "seed_oss", "starcoder2", "arcee", "nemotron",
                                            "apertus", "hunyuan", "cohere", "cohere2", "gpt_neox", "phi",
                                            "stablelm", "gemma3_mm"}
    assert all(FAMILIES[a] is f for f in FAMILY_LIST for a in f.architectures)
    assert not set(FAMILIES) & set(REFUSED)  # an architecture is trained or refused, never both


def test_llama3_rope_is_read_from_the_config_and_needs_all_its_fields() -> None:
    arch = arch_of(rope_parameters=LLAMA3_ROPE)
    assert arch.llama3_rope == (32.0, 1.0, 4.0, 8192) and arch.rope_theta == 500000.0
    legacy = arch_of(rope_scaling={**LLAMA3_ROPE, "rope_type": None, "type": "llama3"}, rope_theta=500000.0)
    assert legacy.llama3_rope == arch.llama3_rope  # transformers 4.x spelling
    partial = {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}
    with pytest.raises(InvalidRequest, match="lacks 'low_freq_factor'"):
        arch_of(rope_parameters=partial)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_yarn_rope_is_read_as_transformers_reads_it(architecture: str) -> None:
    """(Qwen3-MoE reads it the same way: its tiny `qwen3-moe-mixed` model has yarn, test_moe_parity.py.)"""
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}
    arch = arch_of(architecture, rope_parameters=yarn)
    assert arch.rope_theta == 1e6 and arch.yarn_rope == (4.0, 32.0, 1.0, 32768, 0.1 * math.log(4.0) + 1.0, True)
    assert arch.attention_scale_factor(0) == arch.attention_scale_factor(1) == arch.yarn_rope[4] ** 2  # every layer
    legacy = arch_of(architecture, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                                 "beta_fast": 16.0, "truncate": False}, rope_theta=1e6)
    assert legacy.yarn_rope == (4.0, 16.0, 1.0, 32768, arch.yarn_rope[4], False)
    derived = arch_of(architecture, rope_parameters={**yarn, "factor": None, "mscale": 2.0, "mscale_all_dim": 1.0},
                      max_position_embeddings=131072)  # fmt: skip
    assert derived.yarn_rope[0] == 4.0 and derived.yarn_rope[4] == (0.2 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1)
    with pytest.raises(InvalidRequest, match="rope_parameters of rope_type 'yarn' lacks 'original_max_position_emb"):
        arch_of(architecture, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert arch_of(architecture).attention_scale_factor(0) == 1.0


def _longrope(**changes) -> dict:
    return {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 24, "long_factor": [4.0] * 24,
            **changes}


def test_phi3_longrope_and_partial_rope_are_read_as_transformers_reads_them() -> None:
    # Phi-4-mini's shape: 3/4 of each head rotates, the original context at the top level, 8x it in all.
    config = {"max_position_embeddings": 4096, "original_max_position_embeddings": 512, "partial_rotary_factor": 0.75}
    arch = arch_of("Phi3ForCausalLM", **config, rope_scaling=_longrope(type="longrope"))
    assert (arch.rotary_fraction, arch.rotary_dim) == (0.75, 48)
    short, long, original, attention = arch.longrope
    assert (short, long, original) == ((1.0,) * 24, (4.0,) * 24, 512)
    assert attention == pytest.approx(math.sqrt(1 + math.log(8) / math.log(512)), rel=1e-12)
    assert arch.attention_scale_factor(0) == 1.0  # on the rotated dims only (modules.apply_rope_attention_factor)
    for alias in ("su", "yarn"):  # transformers' Phi3Config reads both as longrope
        assert arch_of("Phi3ForCausalLM", **config, rope_scaling=_longrope(type=alias)).longrope == arch.longrope
    # Phi-3.5-mini: longrope over the whole head (32 frequencies), the original context inside the RoPE parameters.
    whole = arch_of("Phi3ForCausalLM", max_position_embeddings=4096, rope_parameters=_longrope(
        short_factor=[1.0] * 32, long_factor=[2.0] * 32, original_max_position_embeddings=4096))
    assert (whole.rotary_dim, whole.longrope[2:]) == (64, (4096, 1.0))


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"long_factor": [4.0] * 32}, "long_factor must be a list of 24 numbers"),
     ({"short_factor": None}, "short_factor must be a list of 24 numbers"),
     ({"attention_factor": 1.5}, "attention factor is 1.5 in transformers .* but 1.1547 in vLLM"),
     ({"factor": 4.0}, "attention factor is 1.10554 in transformers"),
     ({"short_mscale": 1.0}, "but 1 in vLLM .from short_mscale"),
     ({"partial_rotary_factor": 1.5}, "partial_rotary_factor 1.5 must be in")],
)  # fmt: skip
def test_longrope_that_would_not_match_transformers_or_vllm_is_refused(changes: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        arch_of("Phi3ForCausalLM", max_position_embeddings=4096, original_max_position_embeddings=512,
                rope_parameters=_longrope(**{"partial_rotary_factor": 0.75, **changes}))  # fmt: skip


@pytest.mark.parametrize(
    ("architecture", "rope_type"),
    [("MistralForCausalLM", "yarn"), ("LlamaForCausalLM", "dynamic"), ("Qwen3ForCausalLM", "llama3"),
     ("Phi3ForCausalLM", "dynamic"), ("Qwen3ForCausalLM", "longrope")],
)  # fmt: skip
def test_unknown_rope_types_are_refused_naming_the_field(architecture: str, rope_type: str) -> None:
    with pytest.raises(InvalidRequest, match=rf"rope_parameters.rope_type '{rope_type}' is not supported"):
        arch_of(architecture, rope_parameters={"rope_type": rope_type, "rope_theta": 1e4})


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"), ({"mlp_bias": True}, "mlp_bias"),
     ({"attention_bias": True}, "attention_bias"),
     ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
      "partial_rotary_factor 0.75 .partial RoPE. is not supported for llama")],
)  # fmt: skip
def test_fields_that_change_the_maths_are_refused_by_name(changes: dict, field: str) -> None:
    with pytest.raises(InvalidRequest, match=field):
        arch_of(**changes)


def test_recognised_but_unsupported_families_say_why() -> None:
    with pytest.raises(InvalidRequest, match=r"PhimoeForCausalLM.*sparsemixer routing is not supported"):
        arch_of("PhimoeForCausalLM")
    with pytest.raises(InvalidRequest, match=r"GPT2LMHeadModel.*supported: \[.*'LlamaForCausalLM'"):
        arch_of("GPT2LMHeadModel")


def test_sliding_windows_are_per_layer_as_transformers_applies_them() -> None:
    assert arch_of("MistralForCausalLM", sliding_window=8).windows == (8, 8)
    assert arch_of("MistralForCausalLM", sliding_window=None).windows == ()
    qwen = dict(sliding_window=16, max_window_layers=1)
    assert arch_of("Qwen2ForCausalLM", **qwen).windows == ()  # use_sliding_window is false
    assert arch_of("Qwen2ForCausalLM", use_sliding_window=True, **qwen).windows == (None, 16)
    typed = arch_of("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    assert typed.windows == (4, None) and typed.window(0) == 4 and typed.window(1) is None
    with pytest.raises(InvalidRequest, match="layer_types"):
        arch_of("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=4, layer_types=["chunked_attention"] * 2)


def test_smollm3_nope_layers_follow_hf_convention() -> None:
    assert arch_of("SmolLM3ForCausalLM", no_rope_layers=[1, 0]).rope_layers == (True, False)
    derived = arch_of("SmolLM3ForCausalLM", num_hidden_layers=4, no_rope_layer_interval=4)
    assert derived.rope_layers == (True, True, True, False)


GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh", "head_dim": 64,
          "query_pre_attn_scalar": 256, "sliding_window": 512, "tie_word_embeddings": True}  # fmt: skip


def test_gemma3_reads_its_norms_scales_windows_and_two_rope_bases() -> None:
    legacy = arch_of(**{**GEMMA3, "architectures": ["Gemma3ForCausalLM"]}, rope_theta=1e6, rope_local_base_freq=1e4,
                     rope_scaling={"rope_type": "linear", "factor": 8.0}, num_hidden_layers=6)  # fmt: skip
    assert (legacy.rope_theta, legacy.local_rope_theta, legacy.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert legacy.windows == (512,) * 5 + (None,)  # sliding_window_pattern 6: every 6th layer is global
    assert legacy.norm_offset and legacy.sandwich_norms and legacy.activation == "gelu_tanh"
    assert legacy.embedding_multiplier == 256**0.5 and legacy.softmax_scale == 256**-0.5
    for field, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                         ("use_bidirectional_attention", True)):  # fmt: skip
        with pytest.raises(InvalidRequest, match=field):
            arch_of(**GEMMA3, **{field: value})
    with pytest.raises(InvalidRequest, match="rope_parameters.full_attention.rope_type 'yarn'"):
        arch_of(**GEMMA3, rope_parameters={"full_attention": {"rope_type": "yarn"}, "sliding_attention": {}})
    with pytest.raises(InvalidRequest, match="hidden_act 'silu' is not supported for gemma3"):
        arch_of(**{**GEMMA3, "hidden_activation": None, "hidden_act": "silu"})


# google/gemma-3-4b-it's, -12b-it's and -27b-it's config.json (transformers 4.50): the text model's fields under
# `text_config`, only those that differ from transformers' Gemma3TextConfig defaults.
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
             "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                             "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},
             "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model",
                               "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}  # fmt: skip
GEMMA3_27B_TEXT = {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                   "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                   "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                   "sliding_window": 1024}  # fmt: skip


def test_multimodal_gemma3_trains_its_text_model_and_carries_the_vision_tower() -> None:
    from transformers import Gemma3TextConfig

    from scalarlm.training.families.gemma import GEMMA3_TEXT_DEFAULTS
    from scalarlm.training.lora import peft_config
    from scalarlm.protocol.training import LoraConfig

    defaults = Gemma3TextConfig().to_dict()
    assert GEMMA3_TEXT_DEFAULTS == {k: defaults[k] for k in GEMMA3_TEXT_DEFAULTS}
    config = GEMMA3_4B  # (its tensor names as the hub's checkpoints and transformers 5 have them)
    names = _names_for(config)
    assert names[0].startswith("language_model.model.") and all(n.startswith("language_model.") for n in names)
    arch = read_arch(config, [*names, "vision_tower.vision_model.post_layernorm.weight",
                              "multi_modal_projector.mm_input_projection_weight"])  # fmt: skip
    assert arch.family == "gemma3_mm"
    shape = (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    assert shape == (2560, 34, 8, 4, 256)
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert arch.windows == ((1024,) * 5 + (None,)) * 5 + (1024,) * 4 and arch.tied_embeddings
    assert arch.vocab_size == 262208 and arch.softmax_scale == 256**-0.5 and arch.activation == "gelu_tanh"
    assert arch.carried == ("vision_tower.", "multi_modal_projector.")
    assert arch.hf_embedding == "language_model.model.embed_tokens.weight"
    config_27b = {**GEMMA3_4B, "text_config": GEMMA3_27B_TEXT}
    big = read_arch(config_27b, _names_for(config_27b))
    assert (big.num_heads, big.num_kv_heads, big.head_dim, big.softmax_scale) == (32, 16, 128, 168**-0.5)
    # as transformers 4.52-4.57 saved it: its module tree's names
    renamed = [n.replace("language_model.model.", "model.language_model.", 1) for n in names]
    newer = read_arch(config, [*renamed, "model.vision_tower.vision_model.post_layernorm.weight"])
    assert newer.model_names[1] == "model.language_model.layers" and newer.hf_head == "lm_head.weight"
    assert newer.carried == ("model.vision_tower.", "model.multi_modal_projector.")
    with pytest.raises(InvalidRequest, match=r"gemma3_mm checkpoint map to nothing .*'model.embed_tokens.weight'"):
        read_arch(config, [n.replace("language_model.model.", "model.", 1) for n in names])  # text-only names
    # the adapter: PEFT keys on transformers' module tree, the tower and projector left out of its targets
    adapter = peft_config(LoraConfig(), arch, "gemma-3-4b-it")
    assert arch.adapter_layers == "model.language_model.layers"
    assert re.fullmatch(adapter["exclude_modules"], "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj")
    assert not re.fullmatch(adapter["exclude_modules"], "model.language_model.layers.0.self_attn.q_proj")
    assert peft_config(LoraConfig(), arch_of(**GEMMA3), "gemma-3-1b")["exclude_modules"] is None


# google/gemma-7b's config.json fields: the GeLU named twice (exact in `hidden_act`, the tanh one it was trained with
# in `hidden_activation`, which vLLM and the trainer read first).
GEMMA = {"architectures": ["GemmaForCausalLM"], "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh",
         "head_dim": 64, "tie_word_embeddings": True, "rope_theta": 10000.0}  # fmt: skip


def test_gemma1_reads_gemmas_norms_scale_and_tanh_geglu_and_nothing_of_gemma2() -> None:
    arch = arch_of(**GEMMA)
    assert arch.family == "gemma" and arch.activation == "gelu_tanh" and arch.norm_offset
    assert not (arch.sandwich_norms or arch.qk_layernorm or arch.windows or arch.attn_logit_softcap)
    assert arch.embedding_multiplier == BASE["hidden_size"] ** 0.5 and arch.softmax_scale == 64**-0.5
    assert arch.rope_theta == 10000.0 and arch.tied_embeddings
    with pytest.raises(InvalidRequest, match="hidden_act 'gelu' is not supported for gemma"):
        arch_of(**{**GEMMA, "hidden_activation": None})  # transformers 5 would run exact GeLU, vLLM the tanh one
    with pytest.raises(InvalidRequest, match="query_pre_attn_scalar is not a Gemma 1 field"):
        arch_of(**GEMMA, query_pre_attn_scalar=256)
    with pytest.raises(InvalidRequest, match="rope_type 'linear' is not supported for gemma"):
        arch_of(**{**GEMMA, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(InvalidRequest, match="use_bidirectional_attention"):
        arch_of(**GEMMA, use_bidirectional_attention=True)


def test_ernie4_5_rotates_adjacent_pairs_and_refuses_biases_vllm_would_drop() -> None:
    arch = arch_of("Ernie4_5ForCausalLM", use_bias=False, tie_word_embeddings=True, rope_theta=500000.0)
    assert arch.family == "ernie4_5" and arch.rotary_interleaved and arch.tied_embeddings
    assert (arch.rope_theta, arch.qkv_bias, arch.qk_layernorm) == (500000.0, False, False)
    with pytest.raises(InvalidRequest, match="use_bias=true is not supported for ernie4_5"):
        arch_of("Ernie4_5ForCausalLM", use_bias=True)


# Seed-OSS-36B-Instruct's fields as its hub config writes them (transformers 4.56: `rope_scaling`, `rope_theta`).
SEED_OSS = {"attention_bias": True, "attention_out_bias": False, "mlp_bias": False, "attention_dropout": 0.1,
            "residual_dropout": 0.1, "rope_scaling": {"rope_type": "default"}, "rope_theta": 10000000.0,
            "head_dim": 128}  # fmt: skip


def test_seed_oss_reads_its_qkv_biases_and_dropouts_and_refuses_an_o_proj_bias() -> None:
    arch = arch_of("SeedOssForCausalLM", **SEED_OSS)
    assert arch.family == "seed_oss" and arch.qkv_bias and not arch.linear_bias
    assert (arch.attention_dropout, arch.hidden_dropout, arch.rope_theta) == (0.1, 0.1, 1e7)
    assert arch_of("SeedOssForCausalLM", **{**SEED_OSS, "residual_dropout": 0}).hidden_dropout == 0.0
    refusal = r"attention_out_bias=true \(a bias on o_proj\) is not supported for seed_oss"
    with pytest.raises(InvalidRequest, match=refusal):
        arch_of("SeedOssForCausalLM", **{**SEED_OSS, "attention_out_bias": True})


# starcoder2-3b's fields as its hub config writes them (transformers 4.x: `rope_theta` at the top level).
STARCODER2 = {"use_bias": True, "norm_epsilon": 1e-5, "hidden_act": "gelu_pytorch_tanh", "sliding_window": 4096,
              "attention_dropout": 0.1, "residual_dropout": 0.1, "embedding_dropout": 0.1, "rope_theta": 999999.44,
              "tie_word_embeddings": True}  # fmt: skip


def test_starcoder2_reads_layer_norms_an_ungated_mlp_biases_windows_and_dropouts() -> None:
    arch = arch_of("Starcoder2ForCausalLM", **STARCODER2)
    assert arch.family == "starcoder2" and arch.layer_norm and not arch.gated_mlp and arch.activation == "gelu_tanh"
    assert arch.qkv_bias and arch.linear_bias and arch.tied_embeddings and arch.windows == (4096, 4096)
    assert (arch.norm_eps, arch.rope_theta) == (1e-5, 999999.44)
    assert (arch.attention_dropout, arch.hidden_dropout, arch.embedding_dropout) == (0.1, 0.1, 0.1)
    names = set(hf_tensor_names(arch))
    assert {"model.layers.0.mlp.c_fc.bias", "model.layers.1.post_attention_layernorm.bias", "model.norm.bias",
            "model.layers.0.self_attn.o_proj.bias"} <= names and not any("gate" in n for n in names)  # fmt: skip
    with pytest.raises(InvalidRequest, match="hidden_act 'gelu' is not supported for starcoder2"):
        arch_of("Starcoder2ForCausalLM", **{**STARCODER2, "hidden_act": "gelu"})


def test_an_ungated_mlp_takes_lora_on_its_own_two_projections() -> None:
    # PEFT's names for StarCoder2's (c_fc, c_proj) and Arcee's (up_proj, down_proj) MLP; the default targets' gate_proj
    # has nothing to adapt there and is left out, as where the whole MLP is named (Tinker's train_mlp); naming it
    # without the rest of the MLP is refused
    starcoder2, arcee = BY_NAME["starcoder2"], BY_NAME["arcee"]
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_targets(starcoder2, [DEFAULT_TARGETS]) == [*attn, "c_fc", "c_proj"]
    mlp = ["gate_proj", "up_proj", "down_proj"]
    assert lora_targets(starcoder2, mlp) == ["c_fc", "c_proj"] and lora_targets(arcee, mlp) == ["up_proj", "down_proj"]
    assert lora_targets(BY_NAME["gpt_neox"], mlp) == ["dense_h_to_4h", "dense_4h_to_h"]
    assert lora_targets(BY_NAME["phi"], mlp) == ["fc1", "fc2"]
    assert lora_targets(starcoder2, ["up_proj", "down_proj"]) == ["c_fc", "c_proj"]
    assert lora_targets(starcoder2, ["c_fc", "q_proj"]) == ["q_proj", "c_fc"]
    assert lora_targets(arcee, [DEFAULT_TARGETS]) == [*attn, "up_proj", "down_proj"]
    assert lora_targets(arcee, ["up_proj"]) == ["up_proj"]
    for family in (starcoder2, arcee):
        with pytest.raises(InvalidRequest, match=rf"\['gate_proj'\] not supported for {family.name}; choose from"):
            lora_targets(family, ["gate_proj", "up_proj"])


# AFM-4.5B's fields as its hub config writes them (transformers 4.x: `rope_scaling`, `rope_theta`).
ARCEE = {"hidden_act": "relu2", "rope_theta": 10000.0, "head_dim": 128, "attention_bias": False, "mlp_bias": False,
         "rope_scaling": {"rope_type": "yarn", "factor": 20.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0}}  # fmt: skip


def test_arcee_reads_an_ungated_relu_squared_mlp_and_yarn() -> None:
    arch = arch_of("ArceeForCausalLM", **ARCEE)
    assert arch.family == "arcee" and not arch.gated_mlp and arch.activation == "squared_relu"
    assert not (arch.layer_norm or arch.linear_bias or arch.qkv_bias) and arch.yarn_rope[:4] == (20.0, 32.0, 1.0, 4096)
    names = set(hf_tensor_names(arch))
    assert {"model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"} <= names
    assert not any("gate" in n for n in names)
    with pytest.raises(InvalidRequest, match="hidden_act 'silu' is not supported for arcee"):
        arch_of("ArceeForCausalLM", **{**ARCEE, "hidden_act": "silu"})
    with pytest.raises(InvalidRequest, match="mlp_bias=true"):
        arch_of("ArceeForCausalLM", **{**ARCEE, "mlp_bias": True})


# Minitron-8B-Base's fields as its hub config writes them (transformers 4.x: `partial_rotary_factor`, `rope_theta` at
# the top level).
NEMOTRON = {"hidden_act": "relu2", "norm_eps": 1e-5, "partial_rotary_factor": 0.5, "rope_theta": 10000,
            "head_dim": 128, "attention_bias": False, "mlp_bias": False}  # fmt: skip


def test_nemotron_reads_zero_centred_layer_norms_half_rope_and_an_ungated_mlp() -> None:
    arch = arch_of("NemotronForCausalLM", **NEMOTRON)
    assert arch.family == "nemotron" and arch.layer_norm and arch.norm_offset and not arch.gated_mlp
    assert (arch.activation, arch.rotary_fraction, arch.norm_eps) == ("squared_relu", 0.5, 1e-5)
    assert not arch.linear_bias
    assert arch_of("NemotronForCausalLM", **{k: v for k, v in NEMOTRON.items()
                                             if k != "partial_rotary_factor"}).rotary_fraction == 0.5  # as transformers
    names = set(hf_tensor_names(arch))
    assert {"model.layers.0.input_layernorm.bias", "model.norm.bias", "model.layers.1.mlp.up_proj.weight"} <= names
    assert not any("gate" in n for n in names)
    assert lora_targets(BY_NAME["nemotron"], [DEFAULT_TARGETS]) == ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                                            "down_proj"]  # fmt: skip


# Apertus-8B's fields as its hub config writes them (transformers 4.56: `rope_scaling`, `rope_theta`).
APERTUS = {"hidden_act": "xielu", "rms_norm_eps": 1e-5, "rope_theta": 12000000, "tie_word_embeddings": False,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}  # fmt: skip


def test_apertus_reads_qk_norms_its_norm_names_and_the_xielu_scalars() -> None:
    arch = arch_of("ApertusForCausalLM", **APERTUS)
    assert arch.family == "apertus" and arch.qk_layernorm and not arch.gated_mlp and arch.activation == "xielu"
    assert arch.llama3_rope == (8.0, 1.0, 4.0, 8192) and arch.rope_theta == 12000000
    names = set(hf_tensor_names(arch))
    assert {"model.layers.0.attention_layernorm.weight", "model.layers.0.feedforward_layernorm.weight",
            "model.layers.1.self_attn.q_norm.weight", "model.layers.1.mlp.act_fn.alpha_p",
            "model.layers.1.mlp.act_fn.alpha_n", "model.layers.1.mlp.act_fn.beta",
            "model.layers.1.mlp.act_fn.eps"} <= names  # fmt: skip
    assert not any("input_layernorm" in n or "post_attention_layernorm" in n or "gate" in n for n in names)
    no_rope = {k: v for k, v in APERTUS.items() if not k.startswith("rope")}
    with pytest.raises(InvalidRequest, match="apertus: a config without its RoPE"):
        arch_of("ApertusForCausalLM", **no_rope)


# Hunyuan-7B-Instruct's fields as its hub config writes them (its own code's names: `rope_scaling` with `alpha`).
HUNYUAN = {"head_dim": 64, "rope_theta": 10000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
           "use_qk_norm": True, "use_cla": False, "use_rotary_pos_emb": True, "norm_type": "rms",
           "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "type": "dynamic"}}  # fmt: skip


def test_hunyuan_reads_post_rope_qk_norms_and_its_ntk_alpha_and_caps_max_seq_len(tmp_path: Path) -> None:
    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model
    from scalarlm.launcher.model_check import check_base_model
    from scalarlm.protocol.training import TrainArgs

    arch = arch_of("HunYuanDenseV1ForCausalLM", **HUNYUAN)
    assert arch.family == "hunyuan" and arch.qk_layernorm and arch.qk_norm_after_rope
    assert arch.rope_theta == pytest.approx(10000.0 * 1000.0 ** (64 / 62)) and arch.rope_max_positions == 32768
    plain = arch_of("HunYuanDenseV1ForCausalLM", **{**HUNYUAN, "rope_scaling": None})
    assert (plain.rope_theta, plain.rope_max_positions) == (10000.0, None)
    names = {r.mcore: r.hf for r in rules(arch)}
    assert names["decoder.layers.1.self_attention.core_attention.q_layernorm.weight"] == (
        "model.layers.1.self_attn.query_layernorm.weight",)
    for field, value in (("use_cla", True), ("use_qk_norm", False), ("use_rotary_pos_emb", False)):
        with pytest.raises(InvalidRequest, match=f"{field}={str(value).lower()} is not supported for hunyuan"):
            arch_of("HunYuanDenseV1ForCausalLM", **{**HUNYUAN, field: value})
    with pytest.raises(InvalidRequest, match="partial_rotary_factor .* is not supported for hunyuan"):
        arch_of("HunYuanDenseV1ForCausalLM", **{**HUNYUAN, "partial_rotary_factor": 0.5})
    with pytest.raises(InvalidRequest, match="rope_type 'yarn' is not supported for hunyuan"):
        arch_of("HunYuanDenseV1ForCausalLM", **{**HUNYUAN, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    model = make_tiny_model(tmp_path / "hunyuan", **FAMILY_TINY_MODELS["hunyuan"])  # max_position_embeddings 1024
    check_base_model(str(model), TrainArgs(max_seq_len=1024))
    with pytest.raises(InvalidRequest, match="max_seq_len 2048 is past hunyuan's max_position_embeddings 1024") as e:
        check_base_model(str(model), TrainArgs(max_seq_len=2048))
    assert e.value.param == "train_args"


# Aya Expanse 8B's fields and Command R7B's as their hub configs write them (transformers 4.x: `rope_theta` at the top
# level; Command R7B's `sliding_window_pattern` without `layer_types`, and fields transformers ignores).
AYA_EXPANSE = {"hidden_act": "silu", "layer_norm_eps": 1e-5, "logit_scale": 0.125, "rope_theta": 10000,
               "use_qk_norm": False, "attention_bias": False, "tie_word_embeddings": True}  # fmt: skip
# Command R+ (104B, 08-2024): Cohere's layers with per-head q/k LayerNorms.
COMMAND_R_PLUS = {**AYA_EXPANSE, "logit_scale": 0.8333333333333334, "rope_theta": 75000000.0, "use_qk_norm": True}
COMMAND_R7B = {**AYA_EXPANSE, "logit_scale": 0.25, "rope_theta": 50000, "num_hidden_layers": 8, "sliding_window": 4096,
               "sliding_window_pattern": 4, "position_embedding_type": "rope_gptj", "rotary_pct": 1.0,
               "order_of_interleaved_layers": "local_attn_first"}  # fmt: skip


def test_cohere_reads_parallel_blocks_bias_free_layer_norms_and_the_logit_scale() -> None:
    arch = arch_of("CohereForCausalLM", **AYA_EXPANSE)
    assert arch.family == "cohere" and arch.parallel_block and arch.layer_norm and not arch.norm_bias
    assert arch.rotary_interleaved and arch.logits_divisor == 8.0 and arch.norm_eps == 1e-5 and arch.tied_embeddings
    assert not (arch.windows or arch.rope_layers or arch.norm_offset)
    names = set(hf_tensor_names(arch))
    assert {"model.layers.0.input_layernorm.weight", "model.norm.weight",
            "model.layers.1.mlp.gate_proj.weight"} <= names  # fmt: skip
    assert not any(n.endswith(".bias") or "post_attention_layernorm" in n for n in names)  # one norm per layer
    assert not any("pre_mlp_layernorm" in r.mcore for r in rules(arch))
    assert arch_of("CohereForCausalLM", **{**AYA_EXPANSE, "logit_scale": None}).logits_divisor == 16.0  # Command R's
    plus = arch_of("CohereForCausalLM", **COMMAND_R_PLUS)  # q/k LayerNorms with a weight per head, sliced over TP
    assert plus.qk_norm_per_head and not (plus.qk_layernorm or plus.qk_norm_over_projection)
    kinds = {r.hf: r.kind for r in rules(plus)}
    assert kinds[("model.layers.1.self_attn.q_norm.weight",)] == kinds[("model.layers.1.self_attn.k_norm.weight",)] \
        == "dim0"  # fmt: skip
    assert not arch.qk_norm_per_head and not any("q_norm" in n for n in hf_tensor_names(arch))
    with pytest.raises(InvalidRequest, match="use_qk_norm=true is not supported for cohere2"):
        arch_of("Cohere2ForCausalLM", **{**COMMAND_R7B, "use_qk_norm": True})
    with pytest.raises(InvalidRequest, match="cohere: a config without its RoPE"):
        arch_of("CohereForCausalLM", **{k: v for k, v in AYA_EXPANSE.items() if k != "rope_theta"})
    with pytest.raises(InvalidRequest, match="logit_scale=0.0 must be positive"):
        arch_of("CohereForCausalLM", **{**AYA_EXPANSE, "logit_scale": 0.0})


def test_cohere2_derives_its_layer_types_and_leaves_rope_out_of_the_full_layers() -> None:
    arch = arch_of("Cohere2ForCausalLM", **COMMAND_R7B)
    assert arch.family == "cohere2" and arch.parallel_block and arch.logits_divisor == 4.0
    full = [3, 7]  # every 4th layer, as transformers derives layer_types from sliding_window_pattern
    assert arch.windows == tuple(None if i in full else 4096 for i in range(8))
    assert arch.rope_layers == tuple(i not in full for i in range(8))
    types = ["sliding_attention", "full_attention"] * 4
    listed = arch_of("Cohere2ForCausalLM", **{**COMMAND_R7B, "layer_types": types})
    assert listed.windows == (4096, None) * 4 and listed.rope_layers == (True, False) * 4
    # transformers rotates only where a layer has a window: none without one
    assert arch_of("Cohere2ForCausalLM", **{**COMMAND_R7B, "sliding_window": None}).rope_layers == (False,) * 8
    with pytest.raises(InvalidRequest, match="layer_types has 2 entries for 8 layers"):
        arch_of("Cohere2ForCausalLM", **{**COMMAND_R7B, "layer_types": types[:2]})
    # without RoPE fields transformers' Cohere2Config takes base 10000, as the common reader does (Cohere's: refused)
    from transformers import Cohere2Config

    bare = arch_of("Cohere2ForCausalLM", **{k: v for k, v in COMMAND_R7B.items() if k != "rope_theta"})
    assert bare.rope_theta == Cohere2Config().rope_parameters["rope_theta"] == 10000.0


# Pythia-1b's fields as its hub config writes them (transformers 4.24: `rotary_pct`, `rotary_emb_base`; no
# `attention_bias`, which transformers takes as true).
PYTHIA = {"hidden_act": "gelu", "layer_norm_eps": 1e-5, "rotary_pct": 0.25, "rotary_emb_base": 10000,
          "num_key_value_heads": None, "rms_norm_eps": None, "use_parallel_residual": True,
          "max_position_embeddings": 2048}  # fmt: skip


def test_gpt_neox_reads_pythias_names_its_parallel_residual_and_partial_rope() -> None:
    arch = arch_of("GPTNeoXForCausalLM", **PYTHIA)
    assert arch.family == "gpt_neox" and arch.parallel_block and arch.parallel_mlp_norm and arch.layer_norm
    assert (arch.rotary_fraction, arch.rope_theta, arch.activation, arch.num_kv_heads) == (0.25, 10000, "gelu", 4)
    assert arch.qkv_bias and arch.linear_bias and arch.fused_qkv and arch.qkv_grouped and not arch.gated_mlp
    names = {r.mcore: (r.hf, r.kind) for r in rules(arch)}
    assert names["embedding.word_embeddings.weight"] == (("gpt_neox.embed_in.weight",), "dim0")
    assert names["output_layer.weight"] == (("embed_out.weight",), "dim0")
    assert names["decoder.layers.1.self_attention.linear_qkv.bias"] == (
        ("gpt_neox.layers.1.attention.query_key_value.bias",), "dim0")  # per head [q; k; v]: megatron's layout
    assert names["decoder.layers.0.pre_mlp_layernorm.bias"] == (("gpt_neox.layers.0.post_attention_layernorm.bias",),
                                                                 "replicated")  # fmt: skip
    assert names["decoder.final_layernorm.weight"][0] == ("gpt_neox.final_layer_norm.weight",)
    assert lora_targets(BY_NAME["gpt_neox"], [DEFAULT_TARGETS]) == ["query_key_value", "dense", "dense_h_to_4h",
                                                            "dense_4h_to_h"]  # fmt: skip
    sequential = arch_of("GPTNeoXForCausalLM", **{**PYTHIA, "use_parallel_residual": False, "hidden_dropout": 0.1})
    assert not sequential.parallel_block and (sequential.hidden_dropout, sequential.embedding_dropout) == (0.1, 0.1)
    with pytest.raises(InvalidRequest, match="attention_bias=false is not supported for gpt_neox"):
        arch_of("GPTNeoXForCausalLM", **{**PYTHIA, "attention_bias": False})
    assert arch_of("GPTNeoXForCausalLM", **{**PYTHIA, "hidden_act": "gelu_fast"}).activation == "gelu_tanh"  # 20B's
    with pytest.raises(InvalidRequest, match="hidden_act 'relu' is not supported for gpt_neox"):
        arch_of("GPTNeoXForCausalLM", **{**PYTHIA, "hidden_act": "relu"})


# phi-2's fields as its hub config writes them (transformers 4.37).
PHI2 = {"hidden_act": "gelu_new", "layer_norm_eps": 1e-5, "partial_rotary_factor": 0.4, "rope_theta": 10000.0,
        "resid_pdrop": 0.1, "embd_pdrop": 0.0, "attention_dropout": 0.0, "qk_layernorm": False, "head_dim": None,
        "num_key_value_heads": 4, "hidden_size": 320, "rms_norm_eps": None}  # fmt: skip


def test_phi_reads_a_parallel_block_on_one_layer_norm_biases_and_the_output_bias() -> None:
    arch = arch_of("PhiForCausalLM", **PHI2)
    assert arch.family == "phi" and arch.parallel_block and not arch.parallel_mlp_norm and arch.layer_norm
    assert arch.qkv_bias and arch.linear_bias and arch.output_bias and not arch.gated_mlp
    assert (arch.rotary_fraction, arch.activation, arch.head_dim, arch.hidden_dropout) == (0.4, "gelu_tanh", 80, 0.1)
    names = {r.mcore: r.hf for r in rules(arch)}
    assert names["output_layer.bias"] == ("lm_head.bias",) and names["decoder.final_layernorm.bias"] == (
        "model.final_layernorm.bias",)
    assert names["decoder.layers.0.self_attention.linear_proj.bias"] == ("model.layers.0.self_attn.dense.bias",)
    assert names["decoder.layers.1.mlp.linear_fc1.weight"] == ("model.layers.1.mlp.fc1.weight",)
    assert not any("pre_mlp_layernorm" in name for name in names)  # one norm per layer
    assert lora_targets(BY_NAME["phi"], [DEFAULT_TARGETS]) == ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"]
    with pytest.raises(InvalidRequest, match="qk_layernorm=true .* is not supported for phi"):
        arch_of("PhiForCausalLM", **{**PHI2, "qk_layernorm": True})


# stablelm-2-1_6b's fields as its hub config writes them (q/k/v biases, partial RoPE, the sequential layer).
STABLELM2 = {"hidden_act": "silu", "layer_norm_eps": 1e-5, "partial_rotary_factor": 0.25, "rope_theta": 10000,
             "use_qkv_bias": True, "qk_layernorm": False, "use_parallel_residual": False, "hidden_dropout": 0.0,
             "rms_norm_eps": None, "num_key_value_heads": 4}  # fmt: skip


def test_stablelm_reads_layer_norms_partial_rope_and_qkv_biases_and_refuses_what_vllm_would_not_serve() -> None:
    arch = arch_of("StableLmForCausalLM", **STABLELM2)
    assert arch.family == "stablelm" and arch.layer_norm and arch.norm_bias and arch.qkv_bias
    assert (arch.rotary_fraction, arch.norm_eps, arch.linear_bias, arch.parallel_block) == (0.25, 1e-5, False, False)
    assert not arch_of("StableLmForCausalLM", **{**STABLELM2, "use_qkv_bias": False}).qkv_bias  # stablelm-3b-4e1t
    for field in ("use_parallel_residual", "qk_layernorm"):  # stablelm-2-12b sets both; vLLM 0.32 ignores them
        with pytest.raises(InvalidRequest, match=f"{field}=true is not supported for stablelm"):
            arch_of("StableLmForCausalLM", **{**STABLELM2, field: True})
    with pytest.raises(InvalidRequest, match="hidden_dropout=0.1 is not supported for stablelm"):
        arch_of("StableLmForCausalLM", **{**STABLELM2, "hidden_dropout": 0.1})
    # vLLM 0.32.0's StableLM takes no adapter: the engine serves them merged (hot_swap), so LoRA trains as on Llama
    assert lora_targets(BY_NAME["stablelm"], [DEFAULT_TARGETS]) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]  # fmt: skip


def test_phi3_trains_with_its_residual_dropout_as_transformers_applies_it() -> None:
    # resid_pdrop on the attention's and the MLP's outputs; embd_pdrop, which transformers' Phi-3 never applies, neither
    arch = arch_of("Phi3ForCausalLM", resid_pdrop=0.1, embd_pdrop=0.1)
    assert (arch.hidden_dropout, arch.attention_dropout) == (0.1, 0.0)
    assert arch_of("Phi3ForCausalLM").hidden_dropout == 0.0
    assert arch_of("LlamaForCausalLM", resid_pdrop=0.1).hidden_dropout == 0.0  # no Llama field: transformers ignores it


# granite-4.0-micro's fields as its hub config writes them (40 layers, 2 here): every layer "attention", no experts,
# the MLP's size in shared_intermediate_size, Granite 3's multipliers.
GRANITE4 = {"layer_types": ["attention", "attention"], "num_local_experts": 0, "num_experts_per_tok": 0,
            "intermediate_size": 8192, "shared_intermediate_size": 512, "position_embedding_type": "rope",
            "attention_multiplier": 0.015625, "embedding_multiplier": 12, "residual_multiplier": 0.22,
            "logits_scaling": 10, "rope_theta": 10000000, "tie_word_embeddings": True}  # fmt: skip


def test_granite4_reads_the_shared_mlp_and_granites_multipliers() -> None:
    arch = arch_of("GraniteMoeHybridForCausalLM", **GRANITE4)
    assert arch.family == "granite4" and arch.ffn_hidden_size == 512 and arch.fused_gate_up
    assert (arch.embedding_multiplier, arch.softmax_scale, arch.residual_multiplier, arch.logits_divisor) == (
        12.0, 0.015625, 0.22, 10.0)  # fmt: skip
    assert arch.rope_layers == () and arch.rope_theta == 10000000.0
    mlp = {r.mcore: r.hf for r in rules(arch) if ".mlp." in r.mcore and r.mcore.startswith("decoder.layers.1.")}
    assert mlp == {"decoder.layers.1.mlp.linear_fc1.weight": ("model.layers.1.shared_mlp.input_linear.weight",),
                   "decoder.layers.1.mlp.linear_fc2.weight": ("model.layers.1.shared_mlp.output_linear.weight",)}
    # transformers 5's own names for the layer types; no position embeddings at all unless "rope"
    assert arch_of("GraniteMoeHybridForCausalLM", **{**GRANITE4, "layer_types": ["full_attention"] * 2}) == arch
    nope = arch_of("GraniteMoeHybridForCausalLM", **{**GRANITE4, "position_embedding_type": "nope"})
    assert nope.rope_layers == (False, False)


@pytest.mark.parametrize(
    ("changes", "words"),
    [({"layer_types": ["mamba", "attention"]}, "layer_types ['mamba']: Granite 4.0's Mamba-2 layers"),
     ({"layer_types": None}, "Mamba-2 layers"),  # transformers reads no layer_types as every layer Mamba
     ({"num_local_experts": 64, "num_experts_per_tok": 6}, "num_local_experts=64: Granite 4.0's routed experts"),
     ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for granite4")],
)  # fmt: skip
def test_granite4_refuses_mamba_layers_and_experts_naming_the_field(changes: dict, words: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        arch_of("GraniteMoeHybridForCausalLM", **{**GRANITE4, **changes})


def test_granite4_lora_targets_its_own_mlp_names() -> None:
    granite4 = BY_NAME["granite4"]
    mlp = ["input_linear", "output_linear"]
    assert lora_targets(granite4, [DEFAULT_TARGETS]) == ["q_proj", "k_proj", "v_proj", "o_proj", *mlp]
    assert lora_targets(granite4, ["down_proj"]) == ["output_linear"]
    assert lora_targets(granite4, ["q_proj", *mlp]) == ["q_proj", *mlp]
    with pytest.raises(InvalidRequest, match=r"fuses \['gate_proj', 'up_proj'\] into 'input_linear'"):
        lora_targets(granite4, ["gate_proj"])
    with pytest.raises(InvalidRequest, match=r"\['gate_up_proj'\] not supported for granite4"):
        lora_targets(granite4, ["gate_up_proj"])


# EXAONE-4.0-32B's fields (64 layers, 3 sliding to 1 global, llama3 RoPE), 4 layers here.
EXAONE4 = {"architectures": ["Exaone4ForCausalLM"], "num_hidden_layers": 4, "sliding_window": 4096,
           "sliding_window_pattern": 4, "layer_types": None, "head_dim": 64,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 16.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}  # fmt: skip


def test_exaone4_reads_output_norms_per_head_qk_norms_sliding_layers_and_global_nope() -> None:
    arch = arch_of(**EXAONE4)
    assert arch.family == "exaone4" and not arch.input_norms and arch.sandwich_norms and arch.qk_layernorm
    assert arch.windows == (4096, 4096, 4096, None)  # every 4th layer global, as transformers derives layer_types
    assert arch.rope_layers == (True, True, True, False)  # the global layer without RoPE
    assert arch.llama3_rope == (16.0, 1.0, 4.0, 8192)
    # the 1.2B: every layer global, all with RoPE
    dense = arch_of(**{**EXAONE4, "sliding_window": None, "layer_types": ["full_attention"] * 4})
    assert dense.windows == () and all(dense.uses_rope(i) for i in range(4))
    with pytest.raises(InvalidRequest, match="sliding_window=4096 with no sliding_attention layers"):
        arch_of(**{**EXAONE4, "layer_types": ["full_attention"] * 4})
    with pytest.raises(InvalidRequest, match="sliding_window=None with some sliding_attention layers"):
        arch_of(**{**EXAONE4, "sliding_window": None, "layer_types": ["sliding_attention", "full_attention"] * 2})
    with pytest.raises(InvalidRequest, match="rope_type 'yarn' is not supported for exaone4"):
        arch_of(**{**EXAONE4, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh", "head_dim": 64,
          "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "num_hidden_layers": 4}  # fmt: skip


def test_gemma2_reads_its_soft_caps_alternating_windows_and_one_rope_base() -> None:
    arch = arch_of(**GEMMA2, rope_theta=10000.0)
    assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (50.0, 30.0)
    assert arch.windows == (4096, None, 4096, None)  # transformers' default layer_types: sliding first
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_linear_factor) == (10000.0, None, None)
    assert arch.norm_offset and arch.sandwich_norms and not arch.qk_layernorm and arch.activation == "gelu_tanh"
    assert arch.embedding_multiplier == 256**0.5 and arch.softmax_scale == 256**-0.5
    uncapped = arch_of(**{**GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (uncapped.attn_logit_softcap, uncapped.final_logit_softcap) == (None, None)
    with pytest.raises(InvalidRequest, match="attn_logit_softcapping=0.0: a soft cap must be positive"):
        arch_of(**{**GEMMA2, "attn_logit_softcapping": 0.0})
    with pytest.raises(InvalidRequest, match="RoPE scaling is not supported for gemma2"):
        arch_of(**GEMMA2, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(InvalidRequest, match="use_bidirectional_attention"):
        arch_of(**GEMMA2, use_bidirectional_attention=True)


OLMO3 = {"architectures": ["Olmo3ForCausalLM"], "sliding_window": 4096, "num_hidden_layers": 4,
         "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}  # fmt: skip


def test_olmo_reads_output_norms_projection_wide_qk_norms_windows_and_rope_bases() -> None:
    olmo2 = arch_of("Olmo2ForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    assert not olmo2.input_norms and olmo2.sandwich_norms and not olmo2.norm_offset
    assert olmo2.qk_norm_over_projection and not olmo2.qk_layernorm  # megatron's per-head norms stay off
    assert (olmo2.rope_theta, olmo2.windows) == (500000.0, ())
    names = set(hf_tensor_names(olmo2))
    assert {"model.layers.0.post_attention_layernorm.weight", "model.layers.0.post_feedforward_layernorm.weight",
            "model.layers.0.self_attn.q_norm.weight"} <= names  # fmt: skip
    assert not {"model.layers.0.input_layernorm.weight", "model.layers.0.pre_feedforward_layernorm.weight"} & names
    kinds = {rule.mcore: rule.kind for rule in rules(olmo2)}
    assert kinds["decoder.layers.1.self_attention.k_layernorm.weight"] == "dim0"  # each TP rank: its heads' slice
    assert kinds["decoder.layers.0.mlp.post_norm.weight"] == "replicated"

    derived = arch_of("Olmo3ForCausalLM", num_hidden_layers=4)  # transformers' defaults: 3 sliding, 1 full; 4096
    assert derived.windows == (4096, 4096, 4096, None) and (derived.rope_theta, derived.yarn_rope) == (5e5, None)
    assert not derived.input_norms and derived.qk_norm_over_projection and derived.local_rope_theta is None
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
    legacy = arch_of(**OLMO3, rope_theta=5e5, rope_scaling=yarn)  # transformers 4.x: the scaling is the full layers'
    assert legacy.yarn_rope == (8.0, 32.0, 1.0, 8192, 0.1 * math.log(8.0) + 1.0, True)  # OLMo 3's 1.2079
    assert (legacy.rope_theta, legacy.local_rope_theta) == (5e5, 5e5)  # the sliding layers rotate unscaled
    assert [legacy.attention_scale_factor(i) for i in range(4)] == [1.0, 1.0, 1.0, legacy.yarn_rope[4] ** 2]
    # transformers 4.x configs: `rope_theta` is the full layers' alone, the sliding layers keep the default base
    quirk = arch_of(**OLMO3, rope_theta=1e4)
    assert (quirk.rope_theta, quirk.local_rope_theta) == (1e4, 5e5)
    per_type = arch_of(**OLMO3, rope_parameters={"full_attention": {**yarn, "rope_theta": 5e5, "attention_factor": 1.5,
                                                                    "beta_fast": 16},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                 "truncate": False})  # fmt: skip
    assert per_type.yarn_rope == (8.0, 16.0, 1.0, 8192, 1.5, False) and per_type.local_rope_theta == 1e4
    with pytest.raises(InvalidRequest, match="rope_parameters.full_attention of rope_type 'yarn' lacks 'original_max"):
        arch_of(**OLMO3, rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 8.0}})
    with pytest.raises(InvalidRequest, match="rope_parameters.sliding_attention.rope_type 'yarn': RoPE scaling on"):
        arch_of(**OLMO3, rope_parameters={"sliding_attention": yarn, "full_attention": {"rope_type": "default"}})
    with pytest.raises(InvalidRequest, match="sliding_window null with a RoPE that differs per layer type"):
        arch_of(**{**OLMO3, "sliding_window": None}, rope_theta=5e5, rope_scaling=yarn)
    assert arch_of(**{**OLMO3, "sliding_window": None}, rope_theta=5e5).windows == ()  # one RoPE: every layer full
    with pytest.raises(InvalidRequest, match=r"rope_scaling.rope_type 'dynamic' is not supported for olmo3"):
        arch_of(**OLMO3, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(InvalidRequest, match="attention_bias"):
        arch_of("Olmo2ForCausalLM", attention_bias=True)


def test_granite_reads_its_four_multipliers() -> None:
    arch = arch_of("GraniteForCausalLM", attention_multiplier=0.0078125, embedding_multiplier=12.0,
                   residual_multiplier=0.22, logits_scaling=16.0)  # fmt: skip
    assert (arch.softmax_scale, arch.embedding_multiplier, arch.residual_multiplier, arch.logits_divisor) == (
        0.0078125, 12.0, 0.22, 16.0)  # fmt: skip
    plain = arch_of("GraniteForCausalLM")  # transformers' defaults: 1.0 each (the attention scale too)
    assert (plain.softmax_scale, plain.embedding_multiplier, plain.residual_multiplier, plain.logits_divisor) == (
        1.0, 1.0, 1.0, 1.0)  # fmt: skip
    assert arch_of().residual_multiplier is None and arch_of().logits_divisor is None  # Llama: none
    with pytest.raises(InvalidRequest, match="logits_scaling=0: Granite's multipliers must be positive"):
        arch_of("GraniteForCausalLM", logits_scaling=0)


def test_glm4_reads_half_interleaved_rope_qkv_biases_and_its_output_norm_names() -> None:
    arch = arch_of("Glm4ForCausalLM", attention_bias=True)  # no partial_rotary_factor: 0.5, as transformers assumes
    assert (arch.rotary_fraction, arch.rotary_dim, arch.rotary_interleaved, arch.qkv_bias) == (0.5, 32, True, True)
    assert arch_of("Glm4ForCausalLM", partial_rotary_factor=0.25).rotary_dim == 16
    names = {rule.hf[0]: rule.mcore for rule in rules(arch)}
    assert names["model.layers.0.post_self_attn_layernorm.weight"] == "decoder.layers.0.self_attention.post_norm.weight"
    assert names["model.layers.0.post_attention_layernorm.weight"] == "decoder.layers.0.pre_mlp_layernorm.weight"
    assert names["model.layers.0.post_mlp_layernorm.weight"] == "decoder.layers.0.mlp.post_norm.weight"
    assert "model.layers.0.self_attn.o_proj.bias" not in {n for rule in rules(arch) for n in rule.hf}
    # LoRA: vLLM 0.32 loads a GLM-4 adapter's MLP input only as gate_proj / up_proj, which GLM-4 fuses: left out.
    glm4 = BY_NAME["glm4"]
    assert lora_targets(glm4, [DEFAULT_TARGETS]) == ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    for named in (["gate_up_proj"], ["q_proj", "up_proj"], ALL_LINEAR):  # (every name, as Tinker's train_mlp asks)
        with pytest.raises(InvalidRequest, match=r"target_modules \[.*'(gate_up|up)_proj'\]: not supported for glm4"):
            lora_targets(glm4, named)
    with pytest.raises(InvalidRequest, match="attention_bias"):  # Llama's attention_bias biases o_proj too
        arch_of("LlamaForCausalLM", attention_bias=True)


def test_tensor_names_are_strict() -> None:
    config = {**BASE, "architectures": ["Qwen3ForCausalLM"]}
    names = _names_for(config)
    assert "model.layers.1.self_attn.k_norm.weight" in names
    with pytest.raises(InvalidRequest, match=r"map to nothing.*'model.layers.0.mlp.experts.0.w1.weight'"):
        read_arch(config, [*names, "model.layers.0.mlp.experts.0.w1.weight"])
    with pytest.raises(InvalidRequest, match=r"lacks 1 tensor.*q_norm"):
        read_arch(config, [n for n in names if n != "model.layers.0.self_attn.q_norm.weight"])
    read_arch(config, [*names, "model.layers.0.self_attn.rotary_emb.inv_freq"])  # derived buffers are tolerated


def test_phi3_lora_targets_are_the_fused_modules() -> None:
    phi3 = BY_NAME["phi3"]
    assert lora_targets(phi3, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]) == [
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # fmt: skip
    assert lora_targets(phi3, ["qkv_proj"]) == ["qkv_proj"]
    with pytest.raises(InvalidRequest, match="fuses"):
        lora_targets(phi3, ["q_proj", "v_proj"])
    with pytest.raises(InvalidRequest, match="qkv_proj"):
        lora_targets(BY_NAME["llama"], ["qkv_proj"])


def test_every_tiny_family_model_reads_as_its_family(tmp_path: Path) -> None:
    from scalarlm.cli.tiny_model import make_tiny_model
    from scalarlm.training.model import model_arch

    for name, family in [("qwen3", "qwen3"), ("phi3", "phi3"), ("llama3", "llama"), ("smollm3", "smollm3")]:
        arch = model_arch(make_tiny_model(tmp_path / name, family=name, hidden=128, heads=2, kv_heads=1))
        assert arch.family == family and arch.head_dim == 64
