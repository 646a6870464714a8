"""What a model family is, read without torch: its shape (`ModelArch`), its tensor rules, its refusals.

A `Family` is a declaration (one short module each: llama.py, qwen3.py, phi3.py, smollm3.py, gemma.py, olmo.py,
granite.py, moe.py). `read_arch` turns an HF `config.json` dict plus the checkpoint's tensor names into a `ModelArch`,
or raises `InvalidRequest` naming the field or tensor it cannot train exactly as Hugging Face runs it. Nothing here
imports torch, so the control plane refuses an unsupported model at submission with the same code the trainer runs.

`rules(arch)` lists every megatron parameter and the HF tensors it is made of; `layouts.py` (torch) does the fusing,
splitting and TP sharding those rules name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import ALL_LINEAR, DEFAULT_TARGETS

Kind = Literal["replicated", "dim0", "dim1", "qkv", "fc1"]
ROPE_FIELD = "rope_parameters.rope_type"
# Derived buffers some checkpoints carry; they are recomputed from the config, never trained (GPT-NeoX checkpoints
# saved by older transformers also carry each layer's causal mask, `attention.bias` / `attention.masked_bias`).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")
# Megatron's name for a MoE layer's experts (SequentialMLP), numbered per rank: `...mlp.experts.local_experts.{j}.`.
LOCAL_EXPERTS = "mlp.experts.local_experts."


@dataclass(frozen=True)
class Rule:
    """One megatron parameter, the HF tensors it is made of (in order), and how it is split across TP ranks."""

    mcore: str
    hf: tuple[str, ...]
    kind: Kind


MLP_NAMES = ("mlp", "gate_up_proj", "down_proj")
# HF names of the attention: its module, its fused q/k/v projection (when fused), its output projection (GPT-NeoX:
# attention, query_key_value, dense).
ATTENTION_NAMES = ("self_attn", "qkv_proj", "o_proj")
# HF names of the model's embedding, its layers, the final norm and the output layer (GPT-NeoX: gpt_neox.embed_in,
# gpt_neox.layers, gpt_neox.final_layer_norm, embed_out).
MODEL_NAMES = ("model.embed_tokens", "model.layers", "model.norm", "lm_head")


def hf_projections(fused_qkv: bool, fused_gate_up: bool, mlp_names: tuple[str, str, str],
                   attention_names: tuple[str, str, str] = ATTENTION_NAMES,
                   ) -> tuple[tuple[str, ...], tuple[str, ...], str]:  # fmt: skip
    """A dense layer's HF projections (module names, no `.weight`): attention's input (q/k/v or the fused one), the
    MLP's input (gate/up or the family's fused one) and the MLP's down projection."""
    _, fused, down = mlp_names
    attn = (attention_names[1],) if fused_qkv else ("q_proj", "k_proj", "v_proj")
    return attn, ((fused,) if fused_gate_up else ("gate_proj", "up_proj")), down


# Views of a stacked entry (`stacked`): every other element of its last axis from the first ("even") or the second
# ("odd") one, then (".T") its two axes swapped. GPT-OSS stores each expert's gate and up interleaved by column in
# one [H, 2I] entry (x @ W): gate = even.T, up = odd.T; its down entry [I, H] is "T".
VIEWS = ("", "T", "even", "odd", "even.T", "odd.T")


def stacked(name: str, index: int, view: str = "") -> str:
    """The source name of entry `index` of a stacked HF tensor (Granite 3 MoE's and GPT-OSS's experts, [E, ...] in one
    tensor), seen through `view` (`VIEWS`): the readers (`hf_io.Weights`, `convert`) take that slice;
    `convert.mcore_to_hf` stacks the entries back."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")
    return f"{name}[{index}:{view}]" if view else f"{name}[{index}]"


def unstacked(name: str) -> tuple[str, int | None]:
    """(the HF tensor, the entry) of a `stacked` source name; (name, None) for a whole tensor."""
    if not name.endswith("]") or "[" not in name:
        return name, None
    base, _, index = name[:-1].rpartition("[")
    return base, int(index.partition(":")[0])


def entry_view(name: str) -> str:
    """The view (`VIEWS`) a `stacked` source name takes of its entry ("" for the entry as stored, or a whole
    tensor)."""
    return name[:-1].rpartition("[")[2].partition(":")[2] if unstacked(name)[1] is not None else ""


SANDWICH_NORM_NAMES = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
INPUT_NORM_NAMES = ("input_layernorm", "post_attention_layernorm")  # Apertus: attention_ / feedforward_layernorm
QK_NORM_NAMES = ("q_norm", "k_norm")  # HunYuan: query_layernorm, key_layernorm


@dataclass(frozen=True)
class LatentAttention:
    """Multi-latent attention's shape (DeepSeek-V2/V3): q through a `q_rank` latent (None: one q_proj), k and v
    expanded per head from one shared `kv_rank` latent; each head's q and k are `nope_dim` dims without RoPE then
    `rope_dim` rotated ones (the rotated key shared by every head), v has `v_dim`. `mscale_all_dim`: HF's yarn
    softmax-scale term (0: none)."""

    q_rank: int | None
    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelArch:
    """A decoder's shape (dense or mixture-of-experts), read from an HF `config.json` (and its tensor names) by its
    family."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tied_embeddings: bool
    qkv_bias: bool = False
    attention_dropout: float = 0.0  # on the attention probabilities in training (HF `attention_dropout`)
    # On the attention's and the MLP's outputs before each residual add, in training (Seed-OSS's `residual_dropout`,
    # Phi-3's `resid_pdrop`; megatron's hidden_dropout).
    hidden_dropout: float = 0.0
    embedding_dropout: float = 0.0  # on the embeddings, in training (StarCoder2's; most of HF's decoders apply none)
    # The MLP's input is one projection, not a [gate; up] pair (`mlp_names`' fused name: StarCoder2's c_fc), its
    # activation applied to all of it (megatron's gated_linear_unit off).
    gated_mlp: bool = True
    layer_norm: bool = False  # LayerNorm (mean removed, with a bias) instead of RMSNorm everywhere (StarCoder2)
    norm_bias: bool = True  # False: that LayerNorm has a weight only, computed in fp32 (Cohere's)
    # Attention and the MLP both read the layer's input and their outputs are added to it together: through its one
    # input norm, `x + attn(norm(x)) + mlp(norm(x))` (Cohere's parallel block; no pre-MLP norm), or with
    # `parallel_mlp_norm` the MLP through its own, `x + attn(norm1(x)) + mlp(norm2(x))` (GPT-NeoX's parallel residual).
    parallel_block: bool = False
    parallel_mlp_norm: bool = False
    qk_layernorm: bool = False  # per-head q/k RMSNorm (megatron's q/k_layernorm; Qwen3, Gemma 3)
    qk_norm_names: tuple[str, str] = QK_NORM_NAMES  # their HF names
    # the per-head q/k norms apply to the rotated q and k, after RoPE (HunYuan; megatron's before: `modules`)
    qk_norm_after_rope: bool = False
    # Positions past which transformers' RoPE changes (HunYuan's `dynamic` RoPE: its frequencies are recomputed for
    # a longer sequence): max_seq_len is capped there (`check_positions`).
    rope_max_positions: int | None = None
    # q/k RMSNorm over the whole projection (every head at once, weights of width heads x head_dim; OLMo 2/3): TP
    # ranks hold their heads' slice of the weight and sum the squares over TP.
    qk_norm_over_projection: bool = False
    # q/k LayerNorms over each head with a weight of its own per head ([heads, head_dim]; Cohere's `use_qk_norm`,
    # Command R+): TP ranks hold their heads' rows.
    qk_norm_per_head: bool = False
    fused_qkv: bool = False  # HF holds one self_attn.qkv_proj ([q; k; v]) instead of q/k/v_proj
    # that fused projection holds each KV group's [q; k; v] in turn, megatron's own layout (GPT-NeoX's query_key_value,
    # per head): split over TP by rows, not regrouped
    qkv_grouped: bool = False
    attention_names: tuple[str, str, str] = ATTENTION_NAMES
    model_names: tuple[str, str, str, str] = MODEL_NAMES
    # A multimodal checkpoint's tensors outside its text model (vision tower, projector), by name prefix: not trained,
    # published unchanged.
    carried: tuple[str, ...] = ()
    # The layers' path in transformers' module tree where it is not their checkpoint name (PEFT's adapter keys).
    adapter_layers: str | None = None
    # HF holds one MLP input projection: mlp.gate_up_proj ([gate; up]), or without `gated_mlp` the up one (c_fc)
    fused_gate_up: bool = False
    # HF names of the dense MLP: its module, its one input projection (with `fused_gate_up`: [gate; up], or the up
    # projection of an ungated MLP) and its down projection (Granite 4.0: shared_mlp, input_linear, output_linear;
    # StarCoder2: mlp, c_fc, c_proj).
    mlp_names: tuple[str, str, str] = MLP_NAMES
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low_freq_factor, high_freq_factor, orig_max
    rope_layers: tuple[bool, ...] = ()  # per layer: applies RoPE (empty = every layer)
    windows: tuple[int | None, ...] = ()  # per layer: sliding window as HF applies it (empty = none)
    # of the MLP: "silu" (SwiGLU), "gelu_tanh" (GeGLU; StarCoder2's ungated GeLU), "gelu" (exact, GPT-NeoX's ungated),
    # "quick_gelu" (x sigmoid(1.702 x), GPT-OSS's), "squared_relu" (relu(x) ** 2, Arcee's ungated MLP) or "xielu"
    # (Apertus's, with learned scalars per layer: `modules.XIELU`)
    activation: str = "silu"
    # zero-centred norms: RMSNorm's x_hat * (1 + w), computed in fp32 (Gemma); with `layer_norm` LayerNorm's (Nemotron)
    norm_offset: bool = False
    sandwich_norms: bool = False  # output norms after attention and after the MLP (Gemma 2/3, OLMo 2/3)
    input_norms: bool = True  # norms before attention and before the MLP (OLMo 2/3: none, output norms only)
    embedding_multiplier: float | None = None  # embeddings scaled by this (Gemma: sqrt(hidden_size))
    softmax_scale: float | None = None  # attention scale (None: head_dim ** -0.5)
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers when it differs (Gemma 3)
    rope_linear_factor: float | None = None  # `linear` RoPE scaling of the global layers (inv_freq / factor)
    # `yarn` RoPE scaling, as transformers computes it (of every layer but those with a `local_rope_theta`): factor,
    # beta_fast, beta_slow, original_max_position_embeddings, attention_factor (cos and sin scaled by it), truncate.
    yarn_rope: tuple[float, float, float, int, float, bool] | None = None
    # `longrope` RoPE scaling (Phi-3.5, Phi-4-mini): per-frequency short and long factors, the original context (a
    # document longer than it rotates with the long ones, as transformers picks them for a sequence that long) and the
    # attention factor (transformers scales cos and sin by it: the rotated dims of q and k).
    longrope: tuple[tuple[float, ...], tuple[float, ...], int, float] | None = None
    rotary_fraction: float = 1.0  # of each head's dims, the leading ones RoPE rotates (HF `partial_rotary_factor`)
    rotary_interleaved: bool = False  # RoPE rotates adjacent pairs of dims (GLM, GPT-J style), not the two halves
    mla: LatentAttention | None = None  # multi-latent attention in place of grouped-query attention (head_dim: q's)
    # HF names of the `sandwich_norms`: attention's output norm, the pre-MLP norm, the MLP's output norm.
    norm_names: tuple[str, str, str] = SANDWICH_NORM_NAMES
    input_norm_names: tuple[str, str] = INPUT_NORM_NAMES  # HF names of the norms before attention and the MLP
    attn_logit_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_logit_softcap: float | None = None  # output logits -> cap * tanh(logits / cap) (Gemma 2)
    residual_multiplier: float | None = None  # attention and MLP outputs scaled by it before the residual add (Granite)
    logits_divisor: float | None = None  # output logits divided by it (Granite's `logits_scaling`)
    output_bias: bool = False  # the output layer has a bias (Phi's `lm_head.bias`; each TP rank its vocabulary's)
    # Mixture of experts (0 experts = dense): routed experts per MoE layer, experts per token, each expert's
    # intermediate size, whether the top-k probabilities are renormalised to sum 1 (HF `norm_topk_prob`; Mixtral
    # always), which layers are MoE (empty = every layer) and the HF names (block, router, gate, up, down).
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    # Shared experts (Qwen2-MoE, GLM-4.5): one SwiGLU MLP of this size beside the routed experts on every MoE layer,
    # its output scaled by sigmoid(shared_expert_gate(x)) when `moe_shared_gate` (0: none). HF names: shared_expert
    # (Qwen2-MoE, with shared_expert_gate) or shared_experts (GLM-4.5): `moe_shared_name`.
    moe_shared_ffn_hidden_size: int = 0
    moe_shared_gate: bool = False
    moe_shared_name: str = "shared_expert"
    moe_norm_topk: bool = True
    # Sigmoid routing (GLM-4.5, DeepSeek-V3): the top k of sigmoid(logits) + a fixed per-expert bias (HF
    # `e_score_correction_bias`, megatron's `expert_bias`, not trained) among the best `moe_groups[1]` of
    # `moe_groups[0]` expert groups; the chosen sigmoid scores renormalised, times `moe_scaling` (HF
    # `routed_scaling_factor`). DeepSeek-V2 (not sigmoid, not renormalised): softmax, then the top k within the
    # chosen groups, times `moe_scaling`.
    moe_sigmoid: bool = False
    moe_groups: tuple[int, int] = (1, 1)
    moe_scaling: float | None = None
    mtp_layers: int = 0  # multi-token-prediction layers after the last one in the checkpoint (not trained: skipped)
    moe_layers: tuple[bool, ...] = ()
    expert_names: tuple[str, str, str, str, str] = ()
    # The experts are two stacked tensors per layer (Granite 3 MoE): `expert_names`' gate is the [E, 2I, H] tensor of
    # every expert's [gate; up], its down the [E, H, I] one (its up is unused), each expert's rule reads its slice.
    stacked_experts: bool = False
    # The experts stacked as GPT-OSS stores them (x @ W, unlike nn.Linear): `expert_names`' gate the [E, H, 2I] tensor
    # of every expert's gate and up interleaved by column (gate first), its down the [E, I, H] one, each with a
    # `<name>_bias` tensor beside it; the names carry no `.weight`.
    interleaved_experts: bool = False
    # Biases on the attention output, the dense MLP's, the router and every expert's projections (GPT-OSS, StarCoder2;
    # megatron's add_bias_linear).
    linear_bias: bool = False
    # A learned logit per head joins every softmax of the attention and takes its share of the probability
    # (GPT-OSS's `sinks`; megatron's learnable softmax offset).
    attention_sinks: bool = False
    # The gated MLP's clamp (GPT-OSS's `swiglu_limit`): gate clamped above at it, up to [-it, it], and (up + 1) used.
    glu_clamp: float | None = None
    # Expert parallelism: (this rank's index, ranks) in the expert-parallel group. Rank r holds experts
    # r * E / ranks ... (r + 1) * E / ranks - 1 as its local experts 0, 1, ...; (0, 1): every expert.
    expert_shard: tuple[int, int] = (0, 1)

    @property
    def local_experts(self) -> range:
        """The global indices of the experts this arch's rank holds, in local order."""
        rank, ranks = self.expert_shard
        per_rank = self.num_experts // ranks
        return range(rank * per_rank, (rank + 1) * per_rank)

    @property
    def hf_embedding(self) -> str:
        return self.model_names[0] + ".weight"

    @property
    def hf_head(self) -> str:
        return self.model_names[3] + ".weight"

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe(self, layer: int) -> bool:
        """Whether 0-based `layer` has a sparse MoE block (else the dense MLP)."""
        return self.num_experts > 0 and (self.moe_layers[layer] if self.moe_layers else True)

    def window(self, layer: int) -> int | None:
        """The sliding window of 0-based `layer` (None = full causal attention)."""
        return self.windows[layer] if self.windows else None

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else True

    @property
    def rotary_dim(self) -> int:
        """How many dims of each head RoPE rotates (the leading ones; MLA: its rope dims, the trailing ones)."""
        return self.mla.rope_dim if self.mla else int(self.head_dim * self.rotary_fraction)

    def uses_local_rope(self, layer: int) -> bool:
        """Whether 0-based `layer` rotates with the sliding layers' own RoPE (`local_rope_theta`, unscaled) instead of
        the model's."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    def attention_scale_factor(self, layer: int) -> float:
        """What 0-based `layer`'s attention scores are multiplied by beyond the softmax scale: YaRN's
        attention_factor squared on the layers it scales (HF scales cos and sin by it, so q and k each carry it). Not
        with MLA, whose heads have dims RoPE leaves alone: there the factor scales the rotated dims (`LatentRope`)."""
        if self.yarn_rope is None or self.uses_local_rope(layer) or self.mla is not None:
            return 1.0
        return self.yarn_rope[4] ** 2


@dataclass(frozen=True)
class TextInside:
    """Where a multimodal checkpoint keeps its text model: the text model's `model_names`, and the name prefixes of the
    tensors around it that training carries through unchanged (`ModelArch.carried`)."""

    model_names: tuple[str, str, str, str]
    carried: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """One model family: the `architectures` it reads and how its config differs from plain Llama."""

    name: str
    architectures: tuple[str, ...]
    rope_types: frozenset[str] = frozenset({"default"})
    # accepts `partial_rotary_factor` < 1 (transformers rotates the leading dims): the factor when a config has none
    partial_rotary: float | None = None
    rotary_interleaved: bool = False
    norm_names: tuple[str, str, str] = SANDWICH_NORM_NAMES
    input_norm_names: tuple[str, str] = INPUT_NORM_NAMES
    qk_layernorm: bool = False
    qk_norm_names: tuple[str, str] = QK_NORM_NAMES
    qk_norm_after_rope: bool = False
    qk_norm_over_projection: bool = False
    parallel_block: bool = False
    fused_qkv: bool = False
    qkv_grouped: bool = False
    attention_names: tuple[str, str, str] = ATTENTION_NAMES
    model_names: tuple[str, str, str, str] = MODEL_NAMES
    fused_gate_up: bool = False
    mlp_names: tuple[str, str, str] = MLP_NAMES
    gated_mlp: bool = True  # False: one MLP input projection, `mlp_names`' fused one (StarCoder2's c_fc, Arcee's up)
    qkv_bias_from_weights: bool = False  # Qwen2: q/k/v carry biases (o_proj none), seen in the tensor names
    windows: Callable[[dict[str, Any], int], tuple[int | None, ...]] = field(default=lambda config, n: ())
    rope_layers: Callable[[dict[str, Any], int], tuple[bool, ...]] = field(default=lambda config, n: ())
    refuse: Callable[[dict[str, Any]], None] = field(default=lambda config: None)
    activations: frozenset[str] = frozenset({"silu"})  # HF `hidden_act` / `hidden_activation` values accepted
    # The config as transformers reads it, where hub configs spell fields their own way (GPT-NeoX's `rotary_pct`;
    # Cohere2's `sliding_window_pattern`): applied before anything else reads it.
    read_config: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda config: config)
    # Family-specific ModelArch fields read from the config (e.g. Gemma's norms, RoPE bases); may refuse.
    extra: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda config: {})
    sandwich_norms: bool = False
    input_norms: bool = True
    lora_refusal: str | None = None  # why LoRA is not supported for this family (None: it is)
    # HF modules an adapter may not target on this family, and why (vLLM cannot load it there; a mixture-of-experts
    # MLP); the default targets (`DEFAULT_TARGETS`, all-linear) leave them out, naming one is refused.
    lora_excluded: tuple[tuple[str, ...], str] = ((), "")
    # A multimodal checkpoint's layouts of its text model (the checkpoint's names tell which it has); empty: one
    # text-only layout, `model_names`.
    text_inside: tuple[TextInside, ...] = ()
    adapter_layers: str | None = None  # ModelArch.adapter_layers
    notes: str = ""

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The HF module names (PEFT `target_modules`, what vLLM loads) this family's adapters may target."""
        attn, mlp, down = hf_projections(self.fused_qkv, self.fused_gate_up, self.mlp_names, self.attention_names)
        return tuple(m for m in (*attn, self.attention_names[2], *mlp, down) if m not in self.lora_excluded[0])

    @property
    def fused_lora_names(self) -> dict[str, tuple[str, ...]]:
        """HF modules this family holds in place of PEFT's usual names (`ALL_LINEAR`), and the names they stand for:
        fused projections (Phi-3's qkv_proj, gate_up_proj) and renamed ones (Granite 4.0's output_linear, StarCoder2's
        c_fc and c_proj, GPT-NeoX's query_key_value and dense)."""
        _, fused, down = self.mlp_names
        _, fused_qkv, o_proj = self.attention_names
        names = {fused_qkv: ("q_proj", "k_proj", "v_proj")}
        if o_proj != "o_proj":
            names[o_proj] = ("o_proj",)
        if fused != "up_proj":
            names[fused] = ("gate_proj", "up_proj") if self.gated_mlp else ("up_proj",)
        return {**names, down: ("down_proj",)} if down != "down_proj" else names


@dataclass(frozen=True)
class Refused:
    """An architecture that is recognised but deliberately not trained, with the reason."""

    architectures: tuple[str, ...]
    reason: str


def _value(config: dict[str, Any], name: str, default: Any = None) -> Any:
    value = config.get(name)
    return default if value is None else value


def rope_parameters(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The RoPE parameters (transformers 5 `rope_parameters`, or 4.x `rope_scaling` + `rope_theta`) and their field."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        return params, "rope_parameters"
    scaling = dict(config.get("rope_scaling") or {})
    scaling["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    scaling.setdefault("rope_theta", _value(config, "rope_theta", 10000.0))
    return scaling, "rope_scaling"


def _read_rope(config: dict[str, Any], family: Family) -> dict[str, Any]:
    """The ModelArch fields of the config's RoPE: `rope_theta`, `rotary_fraction` when partial, and `llama3_rope`,
    `yarn_rope` or `longrope` when scaled (`dynamic`: `rope_max_positions`)."""
    params, where = rope_parameters(config)
    rope_type = params.get("rope_type") or "default"
    if rope_type in ("su", "yarn") and "longrope" in family.rope_types and rope_type not in family.rope_types:
        rope_type = "longrope"  # transformers' Phi3Config reads both as longrope (the first 128k checkpoints say "su")
    if rope_type not in family.rope_types:
        raise InvalidRequest(
            f"{where}.rope_type {rope_type!r} is not supported for {family.name} "
            f"(supported: {sorted(family.rope_types)})",
            param="model",
        )
    theta = float(params.get("rope_theta") or _value(config, "rope_theta", 10000.0))
    out: dict[str, Any] = {"rope_theta": theta, **_rotary_fraction(config, params, family)}
    max_position = int(_value(config, "max_position_embeddings", 4096))
    if rope_type == "dynamic":
        # transformers' dynamic NTK RoPE: the default frequencies (with HunYuan's NTK `alpha`, of the base
        # theta * alpha ** (d / (d - 2))) up to max_position_embeddings, recomputed for a longer sequence
        if alpha := params.get("alpha"):
            head_dim = _head_dim(config)
            out["rope_theta"] = theta * float(alpha) ** (head_dim / (head_dim - 2))
        return {**out, "rope_max_positions": max_position}
    if rope_type == "yarn":
        return {**out, "yarn_rope": read_yarn(params, where, max_position, params.get("truncate", True))}
    if rope_type == "longrope":
        rotary_dim = int(_head_dim(config) * out.get("rotary_fraction", 1.0))
        return {**out, "longrope": read_longrope(config, params, where, max_position, rotary_dim)}
    if rope_type != "llama3":
        return out
    try:
        llama3 = (
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise InvalidRequest(f"{where} of rope_type 'llama3' lacks {e.args[0]!r}", param="model") from None
    return {**out, "llama3_rope": llama3}


def refuse_without_rope(config: dict[str, Any], family: str, assumed: str) -> None:
    """InvalidRequest for a config without its RoPE fields, where transformers' config class assumes `assumed` (not
    the 10000 base the common reader would take)."""
    if not any(config.get(k) for k in ("rope_parameters", "rope_scaling", "rope_theta")):
        raise InvalidRequest(f"{family}: a config without its RoPE (rope_parameters) is not supported: transformers "
                             f"then assumes {assumed}; write those fields into config.json", param="model")  # fmt: skip


def _head_dim(config: dict[str, Any]) -> int:
    return int(_value(config, "head_dim", int(config["hidden_size"]) // int(config["num_attention_heads"])))


def _rotary_fraction(config: dict[str, Any], params: dict[str, Any], family: Family) -> dict[str, float]:
    """`{"rotary_fraction": f}` for a `partial_rotary_factor` f < 1 the family accepts (none for 1)."""
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", family.partial_rotary))
    if partial is None or float(partial) == 1.0:
        return {}
    if family.partial_rotary is None:
        raise InvalidRequest(f"partial_rotary_factor {partial} (partial RoPE) is not supported for {family.name}",
                             param="model")  # fmt: skip
    if not 0.0 < float(partial) < 1.0:
        raise InvalidRequest(f"partial_rotary_factor {partial} must be in (0, 1]", param="model")
    return {"rotary_fraction": float(partial)}


def _longrope_attention(factor: float, original: int) -> float:
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def read_longrope(config: dict[str, Any], params: dict[str, Any], where: str, max_position_embeddings: int,
                  rotary_dim: int) -> tuple[tuple[float, ...], tuple[float, ...], int, float]:  # fmt: skip
    """`longrope` parameters as transformers reads them (`_compute_longrope_parameters`): the original context from the
    config's top level first (Phi-3 keeps it there), the attention factor from `attention_factor` or from the factor
    (max_position_embeddings / original when absent). vLLM 0.32 computes its own from the context lengths, or takes
    `short_mscale` / `long_mscale` (transformers ignores those): a config on which the two differ is refused, since
    the trained and the served model would not match."""
    original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    original = int(original or max_position_embeddings)
    factors = []
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if not isinstance(values, list) or len(values) != rotary_dim // 2:
            raise InvalidRequest(f"{where}.{name} must be a list of {rotary_dim // 2} numbers (one per rotary "
                                 f"frequency)", param="model")  # fmt: skip
        factors.append(tuple(float(v) for v in values))
    factor = float(params.get("factor") or max_position_embeddings / original)
    attention = params.get("attention_factor")
    attention = _longrope_attention(factor, original) if attention is None else float(attention)
    served = _longrope_attention(max_position_embeddings / original, original)
    for name in ("short_mscale", "long_mscale"):
        vllm = served if params.get(name) is None else float(params[name])
        if not math.isclose(vllm, attention, rel_tol=1e-6):
            raise InvalidRequest(f"{where}: longrope's attention factor is {attention:.6g} in transformers (from "
                                 f"attention_factor or factor) but {vllm:.6g} in vLLM (from {name} or "
                                 f"max_position_embeddings / original_max_position_embeddings)",
                                 param="model")  # fmt: skip
    return factors[0], factors[1], original, attention


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_yarn(params: dict[str, Any], where: str, max_position_embeddings: int,
              truncate: bool) -> tuple[float, float, float, int, float, bool]:  # fmt: skip
    """`yarn` RoPE parameters as transformers reads them (`_compute_yarn_parameters`): a missing factor is
    max_position_embeddings / original_max_position_embeddings, a missing attention_factor comes from the factor (and
    `mscale` / `mscale_all_dim` when both are set). `truncate` is passed in: transformers reads it from the top level
    of `rope_parameters`, not from a layer type's entry."""
    if params.get("original_max_position_embeddings") is None:
        raise InvalidRequest(f"{where} of rope_type 'yarn' lacks 'original_max_position_embeddings'", param="model")
    original = int(params["original_max_position_embeddings"])
    factor = float(params["factor"]) if params.get("factor") is not None else max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) if mscale and all_dim else \
            _yarn_mscale(factor)  # fmt: skip
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
    return factor, beta_fast, beta_slow, original, float(attention), truncate


ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "relu2": "squared_relu", "xielu": "xielu",
               "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}  # fmt: skip
# (gelu_new and gelu_fast: transformers' spellings of the tanh approximation, written out; equal up to rounding)


def _activation(config: dict[str, Any], family: Family) -> str:
    name = "hidden_activation" if config.get("hidden_activation") is not None else "hidden_act"
    act = _value(config, name, "silu")
    if act not in family.activations:
        raise InvalidRequest(
            f"{name} {act!r} is not supported for {family.name} (supported: {sorted(family.activations)})",
            param="model",
        )
    return ACTIVATIONS[act]


def _refuse_common(config: dict[str, Any], qkv_bias: bool) -> None:
    """Fields that change the maths of a Llama-shaped decoder in ways the trainer does not implement (`qkv_bias`: the
    family's `attention_bias` means q/k/v biases only, read from the tensor names)."""
    if quantized := config.get("quantization_config"):
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        fine_grained = method == "fp8" and quantized.get("weight_block_size")
        hint = " (`scalarlm dequantize DIR -o OUT` writes a bf16 copy)" if method == "mxfp4" or fine_grained else ""
        raise InvalidRequest(f"the checkpoint is quantized (quantization_config: {method}); the trainer needs its "
                             f"weights in bf16, fp16 or fp32: dequantize it first{hint}", param="model")  # fmt: skip
    if config.get("mlp_bias"):
        raise InvalidRequest("mlp_bias=true (biases on the MLP) is not supported", param="model")
    if config.get("attention_bias") and not qkv_bias:
        raise InvalidRequest(
            "attention_bias=true (biases on q/k/v and the attention output) is not supported", param="model"
        )


def read_arch(config: dict[str, Any], tensor_names: Iterable[str], families: dict[str, Family],
              refused: dict[str, Refused]) -> ModelArch:  # fmt: skip
    """The shape of the model `config` describes, checked against its tensor names; InvalidRequest if refused."""
    archs = list(config.get("architectures") or [])
    for arch in archs:
        if arch in refused:
            raise InvalidRequest(f"model architecture {arch!r} is not supported: {refused[arch].reason}", param="model")
    family = next((families[a] for a in archs if a in families), None)
    if family is None:
        raise InvalidRequest(
            f"model architecture {archs or config.get('model_type')} is not supported; "
            f"supported: {sorted(families)}",
            param="model",
        )
    config = family.read_config(config)
    _refuse_common(config, family.qkv_bias_from_weights)
    family.refuse(config)
    activation = _activation(config, family)
    names = set(tensor_names)
    extra = family.extra(config)
    rope = {} if "rope_theta" in extra else _read_rope(config, family)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    inside = next((t for t in family.text_inside if f"{t.model_names[0]}.weight" in names), None)
    if inside is None and family.text_inside:
        inside = family.text_inside[0]  # (check_tensor_names names what it lacks)
    model_names = inside.model_names if inside else family.model_names
    qkv = hf_projections(family.fused_qkv, family.fused_gate_up, family.mlp_names, family.attention_names)[0]
    first_qkv_bias = f"{model_names[1]}.0.{family.attention_names[0]}.{qkv[0]}.bias"
    qkv_bias = family.qkv_bias_from_weights and first_qkv_bias in names
    arch = ModelArch(
        family=family.name,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_value(config, "num_key_value_heads", heads)),
        head_dim=extra.pop("head_dim", int(_value(config, "head_dim", hidden // heads))),  # MLA: q's head
        ffn_hidden_size=extra.pop("ffn_hidden_size", int(config["intermediate_size"])),
        norm_eps=extra.pop("norm_eps", float(_value(config, "rms_norm_eps", 1e-6))),  # StarCoder2: norm_epsilon
        max_position_embeddings=int(_value(config, "max_position_embeddings", 4096)),
        tied_embeddings=bool(_value(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        attention_dropout=float(_value(config, "attention_dropout", 0.0)),
        qk_layernorm=extra.pop("qk_layernorm", family.qk_layernorm),  # GLM-4.5: per config (`use_qk_norm`)
        qk_norm_names=family.qk_norm_names,
        qk_norm_after_rope=family.qk_norm_after_rope,
        qk_norm_over_projection=family.qk_norm_over_projection,
        fused_qkv=family.fused_qkv,
        fused_gate_up=family.fused_gate_up,
        mlp_names=family.mlp_names,
        gated_mlp=family.gated_mlp,
        rope_layers=family.rope_layers(config, layers),
        windows=family.windows(config, layers),
        activation=extra.pop("activation", activation),  # GPT-OSS: its experts' own, whatever hidden_act says
        sandwich_norms=family.sandwich_norms,
        input_norms=family.input_norms,
        parallel_block=extra.pop("parallel_block", family.parallel_block),  # GPT-NeoX: per config
        qkv_grouped=family.qkv_grouped,
        attention_names=family.attention_names,
        model_names=model_names,
        carried=inside.carried if inside else (),
        adapter_layers=family.adapter_layers,
        rotary_interleaved=family.rotary_interleaved,
        norm_names=family.norm_names,
        input_norm_names=family.input_norm_names,
        **rope,
        **extra,
    )
    if arch.num_heads % arch.num_kv_heads:
        raise InvalidRequest(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {arch.num_kv_heads}", param="model"
        )
    check_tensor_names(arch, names)
    return arch


def rules(arch: ModelArch) -> Iterator[Rule]:
    """Every parameter of the megatron model and its HF source tensors."""
    _, layers, final_norm, _ = arch.model_names
    attention, _, o_proj = arch.attention_names
    qkv_kind = "dim0" if arch.qkv_grouped else "qkv"  # already megatron's per-group layout: TP rows as they are
    yield Rule("embedding.word_embeddings.weight", (arch.hf_embedding,), "dim0")
    for i in range(arch.num_layers):
        hf, mc = f"{layers}.{i}.", f"decoder.layers.{i}."
        attn, mlp = f"{hf}{attention}.", f"{hf}{arch.mlp_names[0]}."
        qkv, fc1, fc2 = hf_projections(arch.fused_qkv, arch.fused_gate_up, arch.mlp_names, arch.attention_names)
        pre_attention, pre_mlp_norm = arch.input_norm_names
        if arch.input_norms:
            yield from _norm_rules(arch, mc + "input_layernorm", hf + pre_attention)
        if arch.mla:
            yield from _latent_attention_rules(arch.mla, attn, mc + "self_attention.")
        else:
            yield Rule(mc + "self_attention.linear_qkv.weight", tuple(f"{attn}{p}.weight" for p in qkv), qkv_kind)
        if arch.qkv_bias:
            yield Rule(mc + "self_attention.linear_qkv.bias", tuple(f"{attn}{p}.bias" for p in qkv), qkv_kind)
        if arch.qk_layernorm or arch.qk_norm_over_projection or arch.qk_norm_per_head:
            sliced = arch.qk_norm_over_projection or arch.qk_norm_per_head
            kind = "dim0" if sliced else "replicated"  # each TP rank: its heads' slice
            where = mc + ("self_attention.core_attention." if arch.qk_norm_after_rope else "self_attention.")
            q_norm, k_norm = arch.qk_norm_names
            yield Rule(where + "q_layernorm.weight", (f"{attn}{q_norm}.weight",), kind)
            yield Rule(where + "k_layernorm.weight", (f"{attn}{k_norm}.weight",), kind)
        yield Rule(mc + "self_attention.linear_proj.weight", (f"{attn}{o_proj}.weight",), "dim1")
        if arch.linear_bias:  # added once, after the TP ranks' partial outputs are summed
            yield Rule(mc + "self_attention.linear_proj.bias", (f"{attn}{o_proj}.bias",), "replicated")
        if arch.attention_sinks:  # one per head: each TP rank its heads'
            yield Rule(mc + "self_attention.core_attention.softmax_offset", (attn + "sinks",), "dim0")
        if arch.sandwich_norms:  # Gemma's and OLMo's post_attention_layernorm is an output norm, not the pre-MLP one
            attention_out, pre_mlp, mlp_out = arch.norm_names
            yield Rule(mc + "self_attention.post_norm.weight", (f"{hf}{attention_out}.weight",), "replicated")
            if arch.input_norms:
                yield Rule(mc + "pre_mlp_layernorm.weight", (f"{hf}{pre_mlp}.weight",), "replicated")
            yield Rule(mc + "mlp.post_norm.weight", (f"{hf}{mlp_out}.weight",), "replicated")
        elif not arch.parallel_block or arch.parallel_mlp_norm:
            yield from _norm_rules(arch, mc + "pre_mlp_layernorm", hf + pre_mlp_norm)
        if arch.is_moe(i):
            yield from _expert_rules(arch, hf, mc)
        else:
            up = "fc1" if arch.gated_mlp else "dim0"  # a [gate; up] pair is split per TP rank as two halves
            yield Rule(mc + "mlp.linear_fc1.weight", tuple(f"{mlp}{p}.weight" for p in fc1), up)
            yield Rule(mc + "mlp.linear_fc2.weight", (f"{mlp}{fc2}.weight",), "dim1")
            if arch.activation == "xielu":  # its learned scalars (alpha_p, alpha_n) and fixed ones (beta, eps)
                for p in ("alpha_p", "alpha_n", "beta", "eps"):
                    yield Rule(f"{mc}mlp.activation_func.{p}", (f"{mlp}act_fn.{p}",), "replicated")
            if arch.linear_bias:
                yield Rule(mc + "mlp.linear_fc1.bias", tuple(f"{mlp}{p}.bias" for p in fc1), up)
                yield Rule(mc + "mlp.linear_fc2.bias", (f"{mlp}{fc2}.bias",), "replicated")
    yield from _norm_rules(arch, "decoder.final_layernorm", final_norm)
    if not arch.tied_embeddings:
        yield Rule("output_layer.weight", (arch.hf_head,), "dim0")
    if arch.output_bias:
        yield Rule("output_layer.bias", (arch.model_names[3] + ".bias",), "dim0")


def _norm_rules(arch: ModelArch, mc: str, hf: str) -> Iterator[Rule]:
    """A norm's weight (and its bias, a LayerNorm's), the same on every TP rank."""
    yield Rule(mc + ".weight", (hf + ".weight",), "replicated")
    if arch.layer_norm and arch.norm_bias:
        yield Rule(mc + ".bias", (hf + ".bias",), "replicated")


def _latent_attention_rules(mla: LatentAttention, hf: str, mc: str) -> Iterator[Rule]:
    """MLA's projections and its two latent norms: the kv down projection whole on every TP rank (`model._layer_specs`
    says why), the others column-parallel (q's down projection gathered after)."""
    if mla.q_rank is None:
        yield Rule(mc + "linear_q_proj.weight", (hf + "q_proj.weight",), "dim0")
    else:
        yield Rule(mc + "linear_q_down_proj.weight", (hf + "q_a_proj.weight",), "dim0")
        yield Rule(mc + "q_layernorm.weight", (hf + "q_a_layernorm.weight",), "replicated")
        yield Rule(mc + "linear_q_up_proj.weight", (hf + "q_b_proj.weight",), "dim0")
    yield Rule(mc + "linear_kv_down_proj.weight", (hf + "kv_a_proj_with_mqa.weight",), "replicated")
    yield Rule(mc + "kv_layernorm.weight", (hf + "kv_a_layernorm.weight",), "replicated")
    yield Rule(mc + "linear_kv_up_proj.weight", (hf + "kv_b_proj.weight",), "dim0")


def _expert_rules(arch: ModelArch, hf: str, mc: str) -> Iterator[Rule]:
    """One MoE layer: HF's router -> megatron's `mlp.router` (replicated), each expert's gate/up -> its
    `linear_fc1` ([gate; up]) and down -> `linear_fc2`, in megatron's local-experts layout (SequentialMLP); only the
    experts of `arch.expert_shard`'s rank, numbered locally."""
    block, router, gate, up, down = arch.expert_names
    yield Rule(mc + "mlp.router.weight", (f"{hf}{block}.{router}.weight",), "replicated")
    if arch.linear_bias:
        yield Rule(mc + "mlp.router.bias", (f"{hf}{block}.{router}.bias",), "replicated")
    if arch.moe_sigmoid:
        yield Rule(mc + "mlp.router.expert_bias", (f"{hf}{block}.{router}.e_score_correction_bias",), "replicated")
    if arch.moe_shared_ffn_hidden_size:
        src, dst = f"{hf}{block}.{arch.moe_shared_name}.", f"{mc}mlp.shared_experts."
        yield Rule(dst + "linear_fc1.weight", (f"{src}gate_proj.weight", f"{src}up_proj.weight"), "fc1")
        yield Rule(dst + "linear_fc2.weight", (f"{src}down_proj.weight",), "dim1")
        if arch.moe_shared_gate:
            yield Rule(dst + "gate_weight", (f"{hf}{block}.shared_expert_gate.weight",), "replicated")
    for local, e in enumerate(arch.local_experts):
        dst = f"{mc}{LOCAL_EXPERTS}{local}."
        if arch.interleaved_experts:
            gate_up, down_proj = f"{hf}{block}.{gate}", f"{hf}{block}.{down}"
            yield Rule(dst + "linear_fc1.weight", (stacked(gate_up, e, "even.T"), stacked(gate_up, e, "odd.T")), "fc1")
            yield Rule(dst + "linear_fc1.bias", (stacked(f"{gate_up}_bias", e, "even"),
                                                 stacked(f"{gate_up}_bias", e, "odd")), "fc1")  # fmt: skip
            yield Rule(dst + "linear_fc2.weight", (stacked(down_proj, e, "T"),), "dim1")
            yield Rule(dst + "linear_fc2.bias", (stacked(f"{down_proj}_bias", e),), "replicated")
            continue
        if arch.stacked_experts:
            yield Rule(dst + "linear_fc1.weight", (stacked(f"{hf}{block}.{gate}.weight", e),), "fc1")
            yield Rule(dst + "linear_fc2.weight", (stacked(f"{hf}{block}.{down}.weight", e),), "dim1")
            continue
        src = f"{hf}{block}.experts.{e}."
        yield Rule(dst + "linear_fc1.weight", (f"{src}{gate}.weight", f"{src}{up}.weight"), "fc1")
        yield Rule(dst + "linear_fc2.weight", (f"{src}{down}.weight",), "dim1")


def hf_tensor_names(arch: ModelArch) -> list[str]:
    """The HF tensor names a checkpoint of `arch` holds (what `mcore_to_hf` produces), each once."""
    return list(dict.fromkeys(unstacked(name)[0] for rule in rules(arch) for name in rule.hf))


def tolerated(arch: ModelArch, name: str) -> bool:
    """HF tensors no rule maps that are still safe to skip: derived RoPE buffers, a tied model's saved lm_head
    (the converter checks it equals the embedding), the multi-token-prediction layers after the last one (GLM-4.5's
    `num_nextn_predict_layers`: transformers does not load them; a published checkpoint has none), and a multimodal
    checkpoint's tensors around its text model (`carried`: published unchanged)."""
    mtp = tuple(f"{arch.model_names[1]}.{i}." for i in range(arch.num_layers, arch.num_layers + arch.mtp_layers))
    return name.endswith(IGNORED_SUFFIXES) or (arch.tied_embeddings and name == arch.hf_head) or \
        bool(mtp and name.startswith(mtp)) or bool(arch.carried and name.startswith(arch.carried))  # fmt: skip


def check_tensor_names(arch: ModelArch, names: set[str]) -> None:
    """InvalidRequest naming tensors no rule maps (they would be dropped silently) or that the rules need (of an
    expert-parallel rank's arch: the checkpoint's tensors of other ranks' experts are not unmapped)."""
    names = {unstacked(name)[0] for name in names}  # a rank's slices of stacked tensors name the tensors
    expected = set(hf_tensor_names(arch))
    every = set(hf_tensor_names(whole_model(arch)))
    unmapped = sorted(n for n in names - every if not tolerated(arch, n))
    if unmapped:
        raise InvalidRequest(
            f"{len(unmapped)} tensor(s) of the {arch.family} checkpoint map to nothing the trainer builds, "
            f"e.g. {unmapped[:4]}: training would drop them",
            param="model",
        )
    missing = sorted(expected - names)
    if missing:
        raise InvalidRequest(
            f"the {arch.family} checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:4]}", param="model"
        )


def expert_rank(arch: ModelArch, rank: int, ranks: int) -> ModelArch:
    """`arch` as expert-parallel rank `rank` of `ranks` holds it (its share of the experts); InvalidRequest unless
    the experts split evenly."""
    if ranks == 1:
        return arch
    if not arch.num_experts:
        raise InvalidRequest(f"expert_parallel_size {ranks} needs a mixture-of-experts model; {arch.family} is dense",
                             param="train_args")  # fmt: skip
    if arch.num_experts % ranks:
        raise InvalidRequest(f"expert_parallel_size {ranks} must divide the model's {arch.num_experts} experts",
                             param="train_args")  # fmt: skip
    return replace(arch, expert_shard=(rank, ranks))


def check_moe_training(arch: ModelArch, aux_loss_coef: float, routing_replay: bool = False) -> None:
    """InvalidRequest for a mixture-of-experts setting the trainer cannot honour on `arch`."""
    if aux_loss_coef > 0 and not arch.num_experts:
        raise InvalidRequest(f"moe_aux_loss_coef {aux_loss_coef:g} needs a mixture-of-experts model; {arch.family} is "
                             "dense: leave it 0", param="train_args")  # fmt: skip
    if routing_replay and not arch.num_experts:
        raise InvalidRequest(f"routing_replay needs a mixture-of-experts model; {arch.family} is dense: leave it false",
                             param="train_args")  # fmt: skip


def whole_model(arch: ModelArch) -> ModelArch:
    """`arch` with every expert (the inverse of `expert_rank`): the layout of a published checkpoint."""
    return arch if arch.expert_shard == (0, 1) else replace(arch, expert_shard=(0, 1))


def check_tensor_parallel(arch: ModelArch, tp: int) -> None:
    """InvalidRequest unless the model splits evenly over `tp` ranks (and its experts may be split at all)."""
    if tp > 1 and arch.num_experts and arch.linear_bias:
        raise InvalidRequest(f"tensor_parallel_size {tp} is not supported for {arch.family}: megatron-core 0.16.1 "
                             "trains experts with biases only unsplit; use expert_parallel_size to spread the "
                             "experts over GPUs")  # fmt: skip
    for what, n in (
        ("num_key_value_heads", arch.num_kv_heads),
        ("num_attention_heads", arch.num_heads),
        ("vocab_size", arch.vocab_size),
        ("intermediate_size", arch.ffn_hidden_size),
        *((("moe_intermediate_size", arch.moe_ffn_hidden_size),) if arch.num_experts else ()),
        *((("shared_expert_intermediate_size", arch.moe_shared_ffn_hidden_size),)
          if arch.moe_shared_ffn_hidden_size else ()),  # fmt: skip
        *((("q_lora_rank", arch.mla.q_rank or 0),) if arch.mla else ()),
    ):
        if n % tp:
            raise InvalidRequest(f"tensor_parallel_size {tp} must divide the model's {what} ({n})")


def check_positions(arch: ModelArch, max_seq_len: int) -> None:
    """InvalidRequest when a training sequence could reach positions where transformers' RoPE for `arch` changes."""
    if arch.rope_max_positions is not None and max_seq_len > arch.rope_max_positions:
        raise InvalidRequest(
            f"max_seq_len {max_seq_len} is past {arch.family}'s max_position_embeddings {arch.rope_max_positions}, "
            "beyond which transformers recomputes its dynamic RoPE: use at most that", param="train_args")


def lora_targets(family: Family, target_modules: Iterable[str]) -> list[str]:
    """The HF modules LoRA targets for `target_modules`, in the family's order; InvalidRequest naming what it cannot
    place.

    Where HF fuses or renames modules (Phi-3's qkv_proj, gate_up_proj; Granite 4.0's input_linear, output_linear),
    naming all of their parts (as the default targets do)
    targets the fused module; naming only some of them cannot be placed and is refused.
    """
    if family.lora_refusal is not None:
        raise InvalidRequest(f"adapter_type 'lora' is not supported for {family.name}: {family.lora_refusal}; "
                             "use adapter_type 'full'", param="train_args")  # fmt: skip
    allowed = family.lora_targets
    fused_names = family.fused_lora_names
    requested = set(target_modules)
    excluded, why = family.lora_excluded
    if requested == {DEFAULT_TARGETS}:  # every module an adapter of this family can be trained and served on
        requested = set(ALL_LINEAR) - {part for fused in excluded for part in (fused, *fused_names.get(fused, ()))}
    if not family.gated_mlp and requested >= {"gate_proj", "up_proj", "down_proj"}:
        requested -= {"gate_proj"}  # the whole MLP in PEFT's names (the default, Tinker's train_mlp): an ungated one's
    for fused in excluded:
        if named := sorted(requested & {fused, *fused_names.get(fused, ())}):
            raise InvalidRequest(f"lora_config.target_modules {named}: not supported for {family.name}: {why}",
                                 param="train_args")  # fmt: skip
    for fused, parts in fused_names.items():
        if fused in allowed and requested & set(parts):
            if not requested >= set(parts):
                raise InvalidRequest(
                    f"lora_config.target_modules: {family.name} fuses {list(parts)} into {fused!r}; "
                    f"target all of them or {fused!r}",
                    param="train_args",
                )
            requested = (requested - set(parts)) | {fused}
    unknown = sorted(requested - set(allowed))
    if unknown or not requested:
        raise InvalidRequest(
            f"lora_config.target_modules {unknown or '[]'} not supported for {family.name}; choose from {list(allowed)}",
            param="train_args",
        )
    return [p for p in allowed if p in requested]


# --- helpers the family declarations share --------------------------------------------------------------------


def pattern_layer_types(config: dict[str, Any], layers: int, default_pattern: int) -> list[str]:
    """`layer_types`, or as transformers derives them when the config has none (Gemma 3, EXAONE 4, Cohere2): every
    `sliding_window_pattern`-th layer full, the rest sliding (`default_pattern` when that is absent too)."""
    if config.get("layer_types") is not None:
        return list(config["layer_types"])
    pattern = int(config.get("sliding_window_pattern") or default_pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def layer_type_windows(config: dict[str, Any], layers: int, enabled: bool) -> tuple[int | None, ...]:
    """Per-layer windows from `layer_types` (Qwen2/Qwen3/SmolLM3): `sliding_window` on "sliding_attention" layers.

    `layer_types` is derived as transformers does when the config lacks it (Qwen: layers >= max_window_layers).
    """
    window = config.get("sliding_window")
    if not enabled or window is None:
        return ()
    types = config.get("layer_types")
    if types is None:
        start = int(_value(config, "max_window_layers", layers))
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise InvalidRequest(f"layer_types has {len(types)} entries for {layers} layers", param="model")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise InvalidRequest(f"layer_types {unknown} are not supported", param="model")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def every_layer_window(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Mistral/Phi-3: `sliding_window`, when set, applies to every layer."""
    window = config.get("sliding_window")
    return () if window is None else (int(window),) * layers
