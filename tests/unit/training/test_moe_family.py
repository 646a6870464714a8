"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, OLMoE, Granite 3 MoE) without torch:
what they read from the config, their per-expert tensor rules (Granite's: slices of stacked tensors), what they
refuse (naming the field), and LoRA refused at submission naming adapter_type."""

from __future__ import annotations

from pathlib import Path

import pytest

from scalarlm.launcher.model_check import check_base_model
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import ALL_LINEAR, DEFAULT_TARGETS, TrainArgs
from scalarlm.training.families import BY_NAME, check_tensor_parallel, hf_tensor_names, read_arch, rules
from scalarlm.training.families.spec import ModelArch, lora_targets

BASE = {
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "hidden_act": "silu", "num_experts_per_tok": 2,
}  # fmt: skip
QWEN3_MOE = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "moe_intermediate_size": 128,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip
QWEN2_MOE = {**BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "moe_intermediate_size": 128,
             "shared_expert_intermediate_size": 512, "norm_topk_prob": False}  # fmt: skip
MIXTRAL = {**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "intermediate_size": 128,
           "router_jitter_noise": 0.0}  # fmt: skip
# GLM-4.5-Air's fields, scaled down: a dense first layer, 1 shared expert, sigmoid routing over 2 groups (1 kept).
GLM4_MOE = {**BASE, "architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 4, "moe_intermediate_size": 128,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
            "routed_scaling_factor": 1.8, "norm_topk_prob": True, "attention_bias": True, "partial_rotary_factor": 0.5,
            "num_nextn_predict_layers": 1}  # fmt: skip

# OLMoE-1B-7B's fields, scaled down: every layer sparse, softmax routing not renormalised, q/k norms over the
# projection.
OLMOE = {**BASE, "architectures": ["OlmoeForCausalLM"], "num_experts": 4, "intermediate_size": 128,
         "norm_topk_prob": False, "clip_qkv": None, "rms_norm_eps": 1e-5, "num_key_value_heads": 4}  # fmt: skip


def _shape(config: dict) -> ModelArch:
    """The arch read from `config` with exactly the tensor names its rules map."""
    family = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe", "Glm4MoeForCausalLM": "glm4_moe",
              "OlmoeForCausalLM": "olmoe"}.get(config["architectures"][0], "mixtral")  # fmt: skip
    first = BY_NAME[family].extra(config)
    qk_norms = first.pop("qk_layernorm", "Qwen3" in config["architectures"][0])
    layers = config["num_hidden_layers"]
    probe = ModelArch(family="probe", vocab_size=1, hidden_size=1, num_layers=layers, num_heads=1, num_kv_heads=1,
                      head_dim=1, ffn_hidden_size=1, norm_eps=0.0, rope_theta=0.0, max_position_embeddings=1,
                      tied_embeddings=False, qk_layernorm=qk_norms, qkv_bias=bool(config.get("attention_bias")),
                      qk_norm_over_projection=BY_NAME[family].qk_norm_over_projection, **first)  # fmt: skip
    return read_arch(config, hf_tensor_names(probe))


def test_qwen3_moe_reads_experts_routing_and_sparse_layers() -> None:
    arch = _shape(QWEN3_MOE)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size) == ("qwen3_moe", 4, 2, 128)
    assert arch.moe_norm_topk and arch.qk_layernorm and all(arch.is_moe(i) for i in range(3))
    mixed = _shape({**QWEN3_MOE, "norm_topk_prob": False, "mlp_only_layers": [1]})
    assert not mixed.moe_norm_topk and [mixed.is_moe(i) for i in range(3)] == [True, False, True]
    stepped = _shape({**QWEN3_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2})
    assert [stepped.is_moe(i) for i in range(4)] == [False, True, False, True]  # HF: (i + 1) % step == 0
    # transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts`
    saved = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert _shape(saved).num_experts == 4


def test_expert_tensors_map_to_megatron_local_experts() -> None:
    arch = _shape({**QWEN3_MOE, "mlp_only_layers": [1]})
    by_mcore = {r.mcore: r for r in rules(arch)}
    router = by_mcore["decoder.layers.0.mlp.router.weight"]
    assert router.hf == ("model.layers.0.mlp.gate.weight",) and router.kind == "replicated"
    fc1 = by_mcore["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.2.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight")
    assert fc1.kind == "fc1"
    assert by_mcore["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"].hf == (
        "model.layers.2.mlp.experts.3.down_proj.weight",)  # fmt: skip
    assert by_mcore["decoder.layers.1.mlp.linear_fc1.weight"].hf == (
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")  # the dense layer  # fmt: skip
    mixtral = {r.mcore: r.hf for r in rules(_shape(MIXTRAL))}
    assert mixtral["decoder.layers.0.mlp.router.weight"] == ("model.layers.0.block_sparse_moe.gate.weight",)
    assert mixtral["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"] == (
        "model.layers.0.block_sparse_moe.experts.1.w1.weight", "model.layers.0.block_sparse_moe.experts.1.w3.weight")
    assert mixtral["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"] == (
        "model.layers.0.block_sparse_moe.experts.1.w2.weight",)  # fmt: skip


def test_qwen2_moe_reads_its_gated_shared_expert_and_maps_it_to_megatrons() -> None:
    arch = _shape(QWEN2_MOE)
    assert (arch.family, arch.num_experts, arch.moe_ffn_hidden_size, arch.moe_norm_topk) == ("qwen2_moe", 4, 128, False)
    assert (arch.moe_shared_ffn_hidden_size, arch.moe_shared_gate, arch.qk_layernorm) == (512, True, False)
    by_mcore = {r.mcore: r for r in rules(arch)}
    fc1 = by_mcore["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.1.mlp.shared_expert.gate_proj.weight",
                      "model.layers.1.mlp.shared_expert.up_proj.weight") and fc1.kind == "fc1"  # fmt: skip
    assert by_mcore["decoder.layers.1.mlp.shared_experts.linear_fc2.weight"].kind == "dim1"
    gate = by_mcore["decoder.layers.1.mlp.shared_experts.gate_weight"]
    assert gate.hf == ("model.layers.1.mlp.shared_expert_gate.weight",) and gate.kind == "replicated"
    with pytest.raises(InvalidRequest, match=r"tensor_parallel_size 2 .* shared_expert_intermediate_size \(511\)"):
        check_tensor_parallel(_shape({**QWEN2_MOE, "shared_expert_intermediate_size": 511}), 2)


def test_glm4_moe_reads_sigmoid_routing_its_fixed_bias_shared_expert_and_dense_layers() -> None:
    arch = _shape(GLM4_MOE)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.moe_sigmoid, arch.moe_groups, arch.moe_scaling) == (
        "glm4_moe", 4, 2, True, (2, 1), 1.8)  # fmt: skip
    assert (arch.moe_layers, arch.moe_shared_ffn_hidden_size, arch.moe_shared_gate) == ((False, True, True), 128, False)
    assert (arch.rotary_fraction, arch.rotary_interleaved, arch.qkv_bias, arch.mtp_layers) == (0.5, False, True, 1)
    assert not arch.qk_layernorm and _shape({**GLM4_MOE, "use_qk_norm": True}).qk_layernorm  # GLM-4.5's: per head
    by_mcore = {r.mcore: r for r in rules(arch)}
    bias = by_mcore["decoder.layers.1.mlp.router.expert_bias"]  # loaded and published, never trained
    assert bias.hf == ("model.layers.1.mlp.gate.e_score_correction_bias",) and bias.kind == "replicated"
    assert by_mcore["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"].hf == (
        "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight")
    assert "decoder.layers.1.mlp.shared_experts.gate_weight" not in by_mcore  # GLM's shared expert has no gate
    assert by_mcore["decoder.layers.0.mlp.linear_fc1.weight"].hf[0] == "model.layers.0.mlp.gate_proj.weight"  # dense
    # The multi-token-prediction layer after the last (layer 3 here) is skipped, as transformers skips it; no other.
    names = hf_tensor_names(arch)
    read_arch(GLM4_MOE, [*names, "model.layers.3.eh_proj.weight", "model.layers.3.mlp.experts.0.up_proj.weight"])
    with pytest.raises(InvalidRequest, match=r"map to nothing.*model.layers.4.eh_proj"):
        read_arch(GLM4_MOE, [*names, "model.layers.4.eh_proj.weight"])


def test_olmoe_reads_every_layer_sparse_softmax_routing_and_qk_norms_over_the_projection() -> None:
    arch = _shape(OLMOE)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size) == ("olmoe", 4, 2, 128)
    assert not arch.moe_norm_topk and arch.qk_norm_over_projection and not arch.qk_layernorm
    assert all(arch.is_moe(i) for i in range(3)) and not arch.moe_shared_ffn_hidden_size
    by_mcore = {r.mcore: r for r in rules(arch)}
    # OLMo 2's norms: each TP rank holds its heads' slice of the q and k norm weights
    q_norm = by_mcore["decoder.layers.0.self_attention.q_layernorm.weight"]
    assert (q_norm.hf, q_norm.kind) == (("model.layers.0.self_attn.q_norm.weight",), "dim0")
    assert by_mcore["decoder.layers.2.mlp.router.weight"].hf == ("model.layers.2.mlp.gate.weight",)
    assert by_mcore["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"].hf == (
        "model.layers.2.mlp.experts.3.down_proj.weight",)  # fmt: skip
    assert _shape({**OLMOE, "norm_topk_prob": True}).moe_norm_topk


def test_missing_or_unmapped_expert_tensors_are_refused() -> None:
    names = hf_tensor_names(_shape(QWEN3_MOE))
    with pytest.raises(InvalidRequest, match=r"lacks 1 tensor.*experts\.3\.up_proj"):
        read_arch(QWEN3_MOE, [n for n in names if n != "model.layers.0.mlp.experts.3.up_proj.weight"])
    with pytest.raises(InvalidRequest, match=r"map to nothing.*shared_expert"):  # e.g. a Qwen2-MoE-style block
        read_arch(QWEN3_MOE, [*names, "model.layers.0.mlp.shared_expert.gate_proj.weight"])


@pytest.mark.parametrize(
    ("config", "field"),
    [({**MIXTRAL, "router_jitter_noise": 0.1}, "router_jitter_noise"),
     ({**QWEN3_MOE, "num_experts_per_tok": 8}, "num_experts_per_tok"),
     ({**QWEN3_MOE, "mlp_only_layers": [7]}, "mlp_only_layers"),
     ({**QWEN3_MOE, "shared_expert_intermediate_size": 64}, "shared experts"),
     ({**GLM4_MOE, "norm_topk_prob": False}, "norm_topk_prob=false with sigmoid routing"),
     ({**GLM4_MOE, "topk_group": 2}, "n_group=2, topk_group=2 with num_experts_per_tok=2"),
     ({**GLM4_MOE, "n_group": 3}, "n_group=3"),
     ({**OLMOE, "clip_qkv": 8.0}, r"clip_qkv=8.0 is not supported \(transformers clamps"),
     ({**OLMOE, "rms_norm_eps": 1e-6}, "rms_norm_eps=1e-06 is not supported for olmoe: vLLM")],
)  # fmt: skip
def test_moe_fields_the_trainer_cannot_follow_are_refused_by_name(config: dict, field: str) -> None:
    with pytest.raises(InvalidRequest, match=field):
        _shape(config) if field != "num_experts_per_tok" else read_arch(config, [])


def test_tensor_parallel_must_split_the_experts() -> None:
    check_tensor_parallel(_shape(QWEN3_MOE), 2)
    with pytest.raises(InvalidRequest, match=r"tensor_parallel_size 2 .* moe_intermediate_size \(127\)"):
        check_tensor_parallel(_shape({**QWEN3_MOE, "moe_intermediate_size": 127}), 2)


MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "olmoe", "granitemoe", "gpt_oss"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lora_on_moe_targets_the_attention_and_refuses_an_mlp_target_by_name(family: str) -> None:
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_targets(BY_NAME[family], [DEFAULT_TARGETS]) == attention  # the default (all-linear): the attention
    assert lora_targets(BY_NAME[family], ["v_proj", "q_proj"]) == ["q_proj", "v_proj"]
    # every name (what a Tinker LoRA client's train_attn and train_mlp ask for) is refused: the MLP is named
    for named in (["gate_proj"], ["q_proj", "down_proj"], ["up_proj", "gate_proj"], ALL_LINEAR):
        with pytest.raises(InvalidRequest, match=r"target_modules \[.*_proj'\]: not supported for .*: adapters on a "
                                                 r"mixture-of-experts model's MLPs .* train_mlp=False") as e:
            lora_targets(BY_NAME[family], named)
        assert e.value.param == "train_args"


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_lora_on_latent_attention_is_refused_naming_adapter_type(family: str) -> None:
    with pytest.raises(InvalidRequest, match=f"adapter_type 'lora' is not supported for {family}: LoRA on multi-head "
                                             "latent attention") as e:  # fmt: skip
        lora_targets(BY_NAME[family], ["q_proj"])
    assert e.value.param == "train_args"


def test_submission_takes_an_attention_adapter_on_a_moe_base_model_and_refuses_an_expert_one(tmp_path: Path) -> None:
    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model
    from scalarlm.protocol.training import LoraConfig

    model = make_tiny_model(tmp_path / "qwen3-moe", **FAMILY_TINY_MODELS["qwen3-moe"])
    check_base_model(str(model), TrainArgs(adapter_type="full"))
    check_base_model(str(model), TrainArgs(adapter_type="lora"))
    experts = TrainArgs(adapter_type="lora", lora_config=LoraConfig(target_modules=["q_proj", "gate_proj"]))
    with pytest.raises(InvalidRequest, match=r"\['gate_proj'\]: not supported for qwen3_moe") as e:
        check_base_model(str(model), experts)
    assert e.value.param == "train_args"


def test_expert_parallel_ranks_hold_their_share_of_the_experts_under_local_names() -> None:
    from scalarlm.training.families import expert_rank, whole_model

    arch = _shape(QWEN3_MOE)
    every = {r.mcore: r.hf for r in rules(arch)}
    seen: dict[str, tuple[str, ...]] = {}
    for rank in range(2):
        mine = expert_rank(arch, rank, 2)
        assert list(mine.local_experts) == [2 * rank, 2 * rank + 1] and whole_model(mine) == arch
        local = {r.mcore: r.hf for r in rules(mine)}
        assert not [n for n in local if ".local_experts.2." in n or ".local_experts.3." in n]
        for name, hf in local.items():
            if ".local_experts." in name:
                assert f".experts.{2 * rank + int(name.split('.local_experts.')[1].split('.')[0])}." in hf[0]
                seen[hf[0]] = hf
            else:
                assert every[name] == hf  # dense tensors and the router: the same on every rank
    assert len(seen) == len([n for n, hf in every.items() if ".local_experts." in n])  # every expert, once


def test_an_expert_parallel_size_the_model_cannot_take_is_refused_at_submission(tmp_path) -> None:
    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model

    moe = make_tiny_model(tmp_path / "qwen3-moe", **FAMILY_TINY_MODELS["qwen3-moe"])
    check_base_model(str(moe), TrainArgs(adapter_type="full", cpu_ranks=2, expert_parallel_size=2))
    with pytest.raises(InvalidRequest, match="expert_parallel_size 8 must divide the model's 4 experts"):
        check_base_model(str(moe), TrainArgs(adapter_type="full", cpu_ranks=8, expert_parallel_size=8))
    dense = make_tiny_model(tmp_path / "dense")
    with pytest.raises(InvalidRequest, match="expert_parallel_size 2 needs a mixture-of-experts model"):
        check_base_model(str(dense), TrainArgs(adapter_type="full", cpu_ranks=2, expert_parallel_size=2))
    with pytest.raises(ValueError, match="x expert_parallel_size 2 must divide the number of ranks 3"):
        TrainArgs(cpu_ranks=3, expert_parallel_size=2)
    assert TrainArgs(cpu_ranks=2, expert_parallel_size=2, loss="grpo").expert_parallel_size == 2  # GRPO at EP too


def test_moe_settings_the_trainer_cannot_honour_are_refused_at_submission(tmp_path) -> None:
    """An aux-loss weight on a dense model means nothing: a 400 naming what to send instead. The aux loss on an MoE
    model is accepted, and so is TP=2 (sequence parallel; test_moe_parity.py trains it)."""
    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model

    moe = make_tiny_model(tmp_path / "qwen3-moe", **FAMILY_TINY_MODELS["qwen3-moe"])
    check_base_model(str(moe), TrainArgs(adapter_type="full", moe_aux_loss_coef=0.01))
    check_base_model(str(moe), TrainArgs(adapter_type="full", cpu_ranks=2, tensor_parallel_size=2))
    dense = make_tiny_model(tmp_path / "dense")
    with pytest.raises(InvalidRequest, match="moe_aux_loss_coef 0.01 needs a mixture-of-experts model; llama is dense"):
        check_base_model(str(dense), TrainArgs(adapter_type="full", moe_aux_loss_coef=0.01))
    with pytest.raises(ValueError, match="moe_aux_loss_coef"):
        TrainArgs(moe_aux_loss_coef=-1)


def test_grpo_iteration_and_routing_replay_settings_that_cannot_work_are_refused(tmp_path) -> None:
    """routing_replay needs an MoE model and a batch trained over more than one step; both settings are GRPO's."""
    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model

    moe = make_tiny_model(tmp_path / "qwen3-moe", **FAMILY_TINY_MODELS["qwen3-moe"])
    check_base_model(str(moe), TrainArgs(adapter_type="full", loss="grpo", num_iterations=2, routing_replay=True))
    dense = make_tiny_model(tmp_path / "dense")
    check_base_model(str(dense), TrainArgs(adapter_type="full", loss="grpo", num_iterations=2))  # TRL's mu, any model
    with pytest.raises(InvalidRequest, match="routing_replay needs a mixture-of-experts model; llama is dense"):
        check_base_model(str(dense), TrainArgs(adapter_type="full", loss="grpo", num_iterations=2, routing_replay=True))
    with pytest.raises(ValueError, match="routing_replay reuses a batch's first-step expert choices .* num_iterations > 1"):
        TrainArgs(loss="grpo", routing_replay=True)
    with pytest.raises(ValueError, match="num_iterations and routing_replay are GRPO settings"):
        TrainArgs(num_iterations=2)


# granite-3.0-1b-a400m's fields, scaled down: every layer sparse, the experts stacked in two tensors per layer.
GRANITE_MOE = {**BASE, "architectures": ["GraniteMoeForCausalLM"], "num_local_experts": 4, "intermediate_size": 128,
               "embedding_multiplier": 12.0, "attention_multiplier": 0.015625, "residual_multiplier": 0.22,
               "logits_scaling": 6.0, "tie_word_embeddings": True}  # fmt: skip
GRANITE_NAMES = ["model.embed_tokens.weight", "model.norm.weight"] + [
    f"model.layers.{i}.{name}.weight" for i in range(3)
    for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "block_sparse_moe.router.layer",
                 "block_sparse_moe.input_linear", "block_sparse_moe.output_linear")]  # fmt: skip


def test_granite_moe_reads_each_experts_slice_of_the_stacked_tensors() -> None:
    from scalarlm.training.families import expert_rank

    arch = read_arch(GRANITE_MOE, GRANITE_NAMES)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size) == ("granitemoe", 4, 2, 128)
    assert arch.moe_norm_topk and arch.stacked_experts and all(arch.is_moe(i) for i in range(3))
    assert (arch.embedding_multiplier, arch.softmax_scale, arch.residual_multiplier, arch.logits_divisor) == (
        12.0, 0.015625, 0.22, 6.0)  # fmt: skip
    by = {r.mcore: (r.hf, r.kind) for r in rules(arch)}
    layer = "decoder.layers.2.mlp."
    assert by[layer + "router.weight"] == (("model.layers.2.block_sparse_moe.router.layer.weight",), "replicated")
    assert by[layer + "experts.local_experts.1.linear_fc1.weight"] == (
        ("model.layers.2.block_sparse_moe.input_linear.weight[1]",), "fc1")  # fmt: skip
    assert by[layer + "experts.local_experts.3.linear_fc2.weight"] == (
        ("model.layers.2.block_sparse_moe.output_linear.weight[3]",), "dim1")  # fmt: skip
    assert sorted(hf_tensor_names(arch)) == sorted(GRANITE_NAMES)  # each stacked tensor named once
    second = {r.mcore: r.hf for r in rules(expert_rank(arch, 1, 2))}  # EP rank 1 holds experts 2 and 3
    assert second[layer + "experts.local_experts.0.linear_fc1.weight"] == (
        "model.layers.2.block_sparse_moe.input_linear.weight[2]",)  # fmt: skip


@pytest.mark.parametrize(("config", "names", "words"), [
    (GRANITE_MOE, [n for n in GRANITE_NAMES if "output_linear" not in n],
     r"lacks 3 tensor\(s\), e.g. \[.model.layers.0.block_sparse_moe.output_linear.weight."),
    (GRANITE_MOE, [*GRANITE_NAMES, "model.layers.0.shared_mlp.input_linear.weight"], "map to nothing"),
    ({**GRANITE_MOE, "architectures": ["GraniteMoeSharedForCausalLM"], "shared_intermediate_size": 256},
     GRANITE_NAMES, "GraniteMoeSharedForCausalLM' is not supported: Granite's MoE with a shared MLP"),
    ({**GRANITE_MOE, "num_experts_per_tok": 5}, GRANITE_NAMES, "num_local_experts=4 with num_experts_per_tok=5"),
])  # fmt: skip
def test_granite_moe_refusals_name_what_to_fix(config: dict, names: list[str], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        read_arch(config, names)


# gpt-oss-20b's fields, scaled down: every layer sparse, sliding and full layers alternating, YaRN, biases, sinks.
GPT_OSS = {**BASE, "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 2, "num_local_experts": 4,
           "intermediate_size": 128, "attention_bias": True, "sliding_window": 128, "swiglu_limit": 7.0,
           "layer_types": ["sliding_attention", "full_attention"],
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 4096}}  # fmt: skip
GPT_OSS_NAMES = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
    f"model.layers.{i}.{name}" for i in range(2)
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.sinks",
                 *(f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")),
                 "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                 "mlp.experts.down_proj", "mlp.experts.down_proj_bias")]  # fmt: skip


def test_gpt_oss_reads_interleaved_experts_biases_and_sinks() -> None:
    from scalarlm.training.families import expert_rank

    arch = read_arch(GPT_OSS, GPT_OSS_NAMES)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size) == ("gpt_oss", 4, 2, 128)
    assert arch.interleaved_experts and arch.linear_bias and arch.attention_sinks and arch.qkv_bias
    assert (arch.activation, arch.glu_clamp, arch.windows) == ("quick_gelu", 7.0, (128, None))
    assert arch.yarn_rope is not None and arch.yarn_rope[0] == 32.0 and arch.yarn_rope[5] is False  # truncate false
    by = {r.mcore: (r.hf, r.kind) for r in rules(arch)}
    layer, hf = "decoder.layers.1.", "model.layers.1."
    assert by[layer + "self_attention.core_attention.softmax_offset"] == ((hf + "self_attn.sinks",), "dim0")
    assert by[layer + "self_attention.linear_proj.bias"] == ((hf + "self_attn.o_proj.bias",), "replicated")
    assert by[layer + "mlp.router.bias"] == ((hf + "mlp.router.bias",), "replicated")
    experts = layer + "mlp.experts.local_experts.3."
    assert by[experts + "linear_fc1.weight"] == ((hf + "mlp.experts.gate_up_proj[3:even.T]",
                                                   hf + "mlp.experts.gate_up_proj[3:odd.T]"), "fc1")  # fmt: skip
    assert by[experts + "linear_fc1.bias"] == ((hf + "mlp.experts.gate_up_proj_bias[3:even]",
                                                 hf + "mlp.experts.gate_up_proj_bias[3:odd]"), "fc1")  # fmt: skip
    assert by[experts + "linear_fc2.weight"] == ((hf + "mlp.experts.down_proj[3:T]",), "dim1")
    assert by[experts + "linear_fc2.bias"] == ((hf + "mlp.experts.down_proj_bias[3]",), "replicated")
    assert sorted(hf_tensor_names(arch)) == sorted(GPT_OSS_NAMES)  # each stacked tensor named once
    second = {r.mcore: r.hf for r in rules(expert_rank(arch, 1, 2))}  # EP rank 1 holds experts 2 and 3
    assert second[layer + "mlp.experts.local_experts.1.linear_fc2.weight"] == (hf + "mlp.experts.down_proj[3:T]",)
    check_tensor_parallel(arch, 1)
    with pytest.raises(InvalidRequest, match="tensor_parallel_size 2 is not supported for gpt_oss: .* expert_parallel"):
        check_tensor_parallel(arch, 2)
    # the hub's config.json (transformers 4.55): `rope_scaling` + `rope_theta`, no `swiglu_alpha`, no `layer_types`
    hub = {k: v for k, v in GPT_OSS.items() if k not in ("rope_parameters", "layer_types")}
    scaling = {k: v for k, v in GPT_OSS["rope_parameters"].items() if k != "rope_theta"}
    assert read_arch({**hub, "rope_scaling": scaling, "rope_theta": 150000.0}, GPT_OSS_NAMES) == arch


@pytest.mark.parametrize(("config", "words"), [
    ({**GPT_OSS, "quantization_config": {"quant_method": "mxfp4"}}, "quantized .*mxfp4.*dequantize it first"),
    ({**GPT_OSS, "swiglu_limit": 10.0}, "swiglu_limit=10.0 is not supported: vLLM 0.32.0's GPT-OSS computes 7.0"),
    ({**GPT_OSS, "swiglu_alpha": 1.0}, "swiglu_alpha=1.0 is not supported"),
    ({**GPT_OSS, "layer_types": ["full_attention", "sliding_attention"]}, "window on the even layers"),
    ({**GPT_OSS, "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}, "rope_type 'default' is not"),
])  # fmt: skip
def test_gpt_oss_refusals_name_what_to_fix(config: dict, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        read_arch(config, GPT_OSS_NAMES)
