"""Build a megatron-core GPTModel (local layer spec, no TransformerEngine) from a Hugging Face Llama-family config.

Llama, Mistral and Qwen2 share one shape: RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, optional qkv bias,
tied or untied embeddings. `ModelArch` reads that shape from `config.json` once; everything downstream (converter,
loss, loop) works from `ModelArch` and never branches on the model type.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from scalarlm.protocol.errors import InvalidRequest

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})


@dataclass(frozen=True)
class ModelArch:
    """The dense Llama-family shape, read from an HF `config.json`."""

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
    qkv_bias: bool
    attention_dropout: float = 0.0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise InvalidRequest(f"RoPE scaling {rope_type!r} is not supported by the trainer yet")
    return float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)


def arch_from_hf_config(config: dict[str, Any], qkv_bias: bool) -> ModelArch:
    """Read the model shape from an HF config dict; `qkv_bias` comes from the checkpoint's tensor names."""
    archs = set(config.get("architectures") or [])
    if not archs & SUPPORTED_ARCHITECTURES:
        raise InvalidRequest(
            f"model architecture {sorted(archs) or config.get('model_type')} is not supported; "
            f"expected one of {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise InvalidRequest(f"activation {config.get('hidden_act')!r} is not supported (SwiGLU/silu only)")
    if config.get("mlp_bias") or (config.get("attention_bias") and not qkv_bias):
        raise InvalidRequest("biases on the MLP or the attention output are not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True):
        logger.warning("sliding_window=%s is ignored: sequences are trained with full causal attention", window)
    return ModelArch(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        attention_dropout=float(config.get("attention_dropout", 0.0) or 0.0),
    )


def check_tensor_parallel(arch: ModelArch, tp: int) -> None:
    """Raise InvalidRequest unless the model splits evenly over `tp` ranks."""
    for what, n in (
        ("num_key_value_heads", arch.num_kv_heads),
        ("num_attention_heads", arch.num_heads),
        ("vocab_size", arch.vocab_size),
        ("intermediate_size", arch.ffn_hidden_size),
    ):
        if n % tp:
            raise InvalidRequest(f"tensor_parallel_size {tp} must divide the model's {what} ({n})")


def transformer_config(arch: ModelArch, tp: int, bf16: bool):
    """The megatron TransformerConfig for `arch`: fusions off, per-token loss (the SFT loss sums over the batch)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        tensor_model_parallel_size=tp,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        calculate_per_token_loss=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def document_bounds(bounds: tuple[int, ...]):
    """Packed-sequence params naming where each document starts and ends in a [1, T] padding-free micro-batch.

    `qkv_format` stays "sbhd", so megatron keeps its ordinary [S, B, ...] path (rope follows `position_ids`) and
    only `SdpaAttention` reads `bounds`; the max lengths size megatron's RoPE table.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))  # the RoPE table megatron builds covers it
    params = PackedSeqParams(qkv_format="sbhd", max_seqlen_q=longest, max_seqlen_kv=longest)
    params.bounds = bounds  # type: ignore[attr-defined]
    return params


def _sdpa_attention_class():
    """megatron's local DotProductAttention with its core replaced by torch SDPA (flash kernel on CPU and GPU)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaAttention(DotProductAttention):
        """Causal attention over [S, B, heads, d]: per document when `packed_seq_params` names document bounds,
        else under `attention_mask` ([B, 1, S, S], True = hidden), else plain causal."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # fmt: skip
            if attention_bias is not None:
                raise NotImplementedError("attention_bias is not supported")
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if groups > 1:
                key = key.repeat_interleave(groups, dim=2)
                value = value.repeat_interleave(groups, dim=2)
            seq, batch = query.shape[0], query.shape[1]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads, S, d]
            opts = {"scale": self.softmax_scale, "dropout_p": self.attention_dropout.p if self.training else 0.0}
            bounds = getattr(packed_seq_params, "bounds", None)
            if bounds is not None:
                out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                                is_causal=True, **opts)
                                 for a, b in zip(bounds[:-1], bounds[1:])], dim=2)  # fmt: skip
            elif attention_mask is not None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, **opts)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **opts)
            return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    return SdpaAttention


def _per_document_rope(freqs: Tensor, position_ids: Tensor) -> Tensor:
    """RoPE angles [S, B, 1, D] at each token's own position ids [B, S] (positions restart per packed document)."""
    table = freqs[:, 0, 0, :]  # [S_max, D]
    return table[position_ids.t()].unsqueeze(2)


def build_gpt_model(arch: ModelArch, tp: int, bf16: bool, parallel_output: bool = True):
    """A megatron-core GPTModel for `arch` on this rank's TP shard (weights uninitialised: load them next)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    class PackedGPTModel(GPTModel):
        """GPTModel whose RoPE follows `position_ids`, so positions restart at each packed document."""

        def _preprocess(self, input_ids, position_ids, *args, **kwargs):
            out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
            if out[1] is None or position_ids is None:
                return out
            return (out[0], _per_document_rope(out[1], position_ids), *out[2:])

    check_tensor_parallel(arch, tp)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    # SDPA instead of megatron's unfused baddbmm + masked softmax + bmm (same maths, one fused kernel).
    spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    return PackedGPTModel(
        config=transformer_config(arch, tp, bf16),
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
    )
