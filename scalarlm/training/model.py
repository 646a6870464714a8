"""Build a megatron-core GPTModel (local layer spec, no TransformerEngine) for a family's `ModelArch`.

Every supported family is a decoder: RMSNorm, gated MLP, RoPE, grouped-query attention. `ModelArch` (read by
`families.read_arch`) carries what differs: qkv bias, q/k norms, llama3 RoPE frequencies, layers without RoPE,
per-layer sliding windows, mixture-of-experts layers (megatron's MoELayer: fp32 top-k router, local SequentialMLP
experts, the allgather token dispatcher). Nothing here branches on the model type.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from scalarlm.training.families import ModelArch, check_tensor_parallel, read_arch
from scalarlm.training.families.checkpoint import read_config, tensor_names
from scalarlm.training.families.modules import adapt

logger = logging.getLogger(__name__)

__all__ = ["ModelArch", "build_gpt_model", "check_tensor_parallel", "document_bounds", "model_arch", "sequence_parallel",
           "transformer_config"]


def model_arch(model_dir: Path) -> ModelArch:
    """The trained shape of the HF checkpoint in `model_dir` (InvalidRequest naming what its family refuses)."""
    return read_arch(read_config(model_dir), tensor_names(model_dir))


def _quick_gelu(x: Tensor) -> Tensor:
    """x sigmoid(1.702 x): GPT-OSS's gate activation (megatron's quick_gelu)."""
    return x * torch.sigmoid(1.702 * x)


def _squared_relu(x: Tensor) -> Tensor:
    """relu(x) ** 2: Arcee's MLP activation (megatron's squared_relu, without its jit decoration)."""
    return torch.square(F.relu(x))


def _per_layer_activation(x: Tensor) -> Tensor:
    raise RuntimeError("a learned activation (xIELU) is each layer's own module: families.modules.apply_xielu")


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"),
                "quick_gelu": _quick_gelu, "squared_relu": _squared_relu, "xielu": _per_layer_activation}  # fmt: skip


def _normalization(arch: ModelArch) -> str:
    return "LayerNorm" if arch.layer_norm else "RMSNorm"


def sequence_parallel(arch: ModelArch, tp: int) -> bool:
    """Whether the trainer runs `arch` at `tp` under megatron's sequence parallelism: a mixture-of-experts model at
    TP > 1 (megatron's MoE layer trains at TP > 1 only so: each TP rank routes its own share of the tokens, the
    dispatcher gathers them for the TP-sharded experts) and a multi-latent attention one (whose shared rotated key's
    gradient is summed over TP only so: `_layer_specs`); a dense model keeps every token on every TP rank."""
    return (bool(arch.num_experts) or arch.mla is not None) and tp > 1


def transformer_config(arch: ModelArch, tp: int, bf16: bool, recompute: bool = False, aux_loss_coef: float = 0.0,
                       sequence_parallel: bool = False):  # fmt: skip
    """The megatron TransformerConfig for `arch`: fusions off, per-token loss (the SFT loss sums over the batch).

    `sequence_parallel`: between the attention and MLP blocks each TP rank holds 1/TP of the sequence (norms and
    routers on its share; the linear layers gather and reduce-scatter it); a micro-batch's length must then divide
    by TP (`losses.token_losses` pads it).
    `recompute` (train arg `gradient_checkpointing`): megatron's full activation recompute, one layer at a time:
    each layer keeps only its input and runs its forward again in backward (same gradients, less memory).
    `aux_loss_coef` (train arg `moe_aux_loss_coef`): the MoE load-balancing loss's weight (`moe_balance`).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    return (MLATransformerConfig if arch.mla else TransformerConfig)(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization=_normalization(arch),
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=arch.gated_mlp,
        activation_func=_ACTIVATIONS[arch.activation],
        softmax_scale=arch.softmax_scale,
        add_bias_linear=arch.linear_bias,
        add_qkv_bias=arch.qkv_bias,
        activation_func_clamp_value=arch.glu_clamp,
        glu_linear_offset=1.0 if arch.glu_clamp is not None else 0.0,
        qk_layernorm=arch.qk_layernorm,
        # megatron's convention is the opposite of HF's no_rope_layers: 1 = skip RoPE on that layer
        no_rope_freq=[0 if arch.uses_rope(i) else 1 for i in range(arch.num_layers)] if arch.rope_layers else None,
        hidden_dropout=arch.hidden_dropout,
        attention_dropout=arch.attention_dropout,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
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
        rotary_interleaved=arch.rotary_interleaved,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        **_moe_config(arch, aux_loss_coef),
        **_mla_config(arch),
    )


def _mla_config(arch: ModelArch) -> dict:
    """megatron's multi-latent attention fields for `arch` (none without MLA). Its RoPE module is replaced by
    `LatentRope`; `rotary_scaling_factor` and `mscale_all_dim` still set the softmax scale, as HF's."""
    if arch.mla is None:
        return {}
    mla, yarn = arch.mla, arch.yarn_rope
    return {
        "q_lora_rank": mla.q_rank, "kv_lora_rank": mla.kv_rank, "qk_head_dim": mla.nope_dim,
        "qk_pos_emb_head_dim": mla.rope_dim, "v_head_dim": mla.v_dim, "rope_type": "yarn" if yarn else "rope",
        "rotary_base": arch.rope_theta, "rotary_scaling_factor": yarn[0] if yarn else 1.0,
        "mscale_all_dim": mla.mscale_all_dim,
    }  # fmt: skip


def _moe_config(arch: ModelArch, aux_loss_coef: float) -> dict:
    """megatron's MoE fields for `arch` (none for a dense model).

    Routing as HF's: softmax over every expert and top k, renormalised when `moe_norm_topk` (= top k of the logits
    and a softmax over those, megatron's `moe_router_pre_softmax=False`), computed in fp32. No token dropping; the
    load-balancing loss only when `aux_loss_coef` > 0 (HF trains without it unless asked); the allgather dispatcher
    (alltoall needs CUDA streams).
    """
    if not arch.num_experts:
        return {}
    return {
        "num_moe_experts": arch.num_experts,
        "moe_router_topk": arch.moe_topk,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": arch.moe_shared_ffn_hidden_size or None,
        "moe_shared_expert_gate": arch.moe_shared_gate,
        "moe_router_pre_softmax": not arch.moe_norm_topk and not arch.moe_sigmoid,
        "moe_router_score_function": "sigmoid" if arch.moe_sigmoid else "softmax",
        "moe_router_enable_expert_bias": arch.moe_sigmoid,
        "moe_router_bias_update_rate": 0.0,  # HF's bias is fixed in training (no aux-loss-free balancing update)
        "moe_router_num_groups": arch.moe_groups[0] if arch.moe_groups[0] > 1 else None,
        "moe_router_group_topk": arch.moe_groups[1] if arch.moe_groups[0] > 1 else None,
        "moe_router_topk_scaling_factor": arch.moe_scaling,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if aux_loss_coef > 0 else "none",
        "moe_aux_loss_coeff": aux_loss_coef,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "moe_layer_freq": [int(arch.is_moe(i)) for i in range(arch.num_layers)],
        "expert_model_parallel_size": arch.expert_shard[1],
        "moe_enable_routing_replay": True,  # megatron's RouterReplay hook; idle unless `moe_replay` sets an action
    }


def document_bounds(bounds: tuple[int, ...], continues: tuple[int, ...] | None = None):
    """Packed-sequence params naming where each document starts and ends in a [1, T] padding-free micro-batch, and
    (`continues`, per document: the one it continues or -1) which ones continue a shared prefix.

    `qkv_format` stays "sbhd", so megatron keeps its ordinary [S, B, ...] path (rope follows `position_ids`) and
    only `SdpaAttention` reads `bounds` and `continues`; the max lengths size megatron's RoPE table.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    # the RoPE table megatron builds covers every position: a continuing part's go on from its prefix's length
    longest = max(n + (sizes[c] if continues and c >= 0 else 0) for n, c in zip(sizes, continues or [-1] * len(sizes)))
    params = PackedSeqParams(qkv_format="sbhd", max_seqlen_q=longest, max_seqlen_kv=longest)
    params.bounds = bounds  # type: ignore[attr-defined]
    params.continues = continues  # type: ignore[attr-defined]
    return params


def _window_mask(n: int, window: int, device: torch.device, before: int = 0) -> Tensor:
    """[n, before + n] True where query i may attend key j: causal and i - j < window (HF's sliding_window_overlay).
    `before`: the keys start with that many of a shared prefix, which the queries follow (query i is at position
    before + i)."""
    offset = (torch.arange(n, device=device) + before)[:, None] - torch.arange(before + n, device=device)[None, :]
    return (offset >= 0) & (offset < window)


def _softcapped_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, cap: float, scale: float | None,
                          dropout_p: float) -> Tensor:  # fmt: skip
    """Attention whose scores are soft-capped before the mask (HF's Gemma 2 eager attention): `cap * tanh(s / cap)`,
    softmax in fp32. SDPA has no soft cap, so this is the explicit product (no fused kernel)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)  # as HF's additive mask: no NaN rows
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    return torch.matmul(probs, v)


SINK_PAD = 8  # head dims a sink key adds (one used): fused SDPA kernels take head sizes in multiples of 8


def _sink_key(q: Tensor, k: Tensor, v: Tensor, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ([B, heads, S, d]) with one key before all the others whose score is `logits` ([heads], before the
    softmax scale) for every query and whose value is 0: a learned sink logit that takes its share of each softmax and
    adds nothing (GPT-OSS), inside SDPA's fused kernels. Each head gains `SINK_PAD` dims: q's first is 1, every real
    key's 0 and the sink key's its logit; the caller drops v's padding from the output."""
    b, h, s, d = q.shape
    one = torch.zeros(SINK_PAD, dtype=q.dtype, device=q.device)
    one[0] = 1.0
    q = torch.cat([q, one.expand(b, h, s, SINK_PAD)], dim=-1)
    sink = torch.cat([k.new_zeros(h, d), logits.to(k.dtype)[:, None], k.new_zeros(h, SINK_PAD - 1)], dim=-1)
    k = torch.cat([sink[None, :, None].expand(b, h, 1, d + SINK_PAD), F.pad(k, (0, SINK_PAD))], dim=2)
    v = F.pad(torch.cat([v.new_zeros(b, h, 1, d), v], dim=2), (0, SINK_PAD))
    return q, k, v


def _sdpa_attention_class(arch: ModelArch):
    """megatron's local DotProductAttention with its core replaced by torch SDPA (flash kernel on CPU and GPU)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaAttention(DotProductAttention):
        """Causal attention over [S, B, heads, d]: per document when `packed_seq_params` names document bounds,
        else under `attention_mask` ([B, 1, S, S], True = hidden), else plain causal; within the layer's sliding
        window when the family has one (per layer, exactly as HF masks it)."""

        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)  # MLA names its q/k and v head sizes: SDPA reads them off the tensors
            self.q_layernorm = self.k_layernorm = None  # after RoPE (HunYuan): `modules.apply_qk_norms_after_rope`
            if arch.attention_sinks:  # megatron's learnable softmax offset (its own allocates it on CUDA)
                self.softmax_offset = torch.nn.Parameter(torch.empty(self.num_attention_heads_per_partition,
                                                                     dtype=self.config.params_dtype))  # fmt: skip

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # fmt: skip
            if attention_bias is not None:
                raise NotImplementedError("attention_bias is not supported")
            if self.q_layernorm is not None:
                query, key = self.q_layernorm(query), self.k_layernorm(key)
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if groups > 1:
                key = key.repeat_interleave(groups, dim=2)
                value = value.repeat_interleave(groups, dim=2)
            seq, batch = query.shape[0], query.shape[1]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads, S, d]
            layer = self.layer_number - 1  # megatron numbers layers from 1
            opts = {"scale": self.softmax_scale * arch.attention_scale_factor(layer),
                    "dropout_p": self.attention_dropout.p if self.training else 0.0}  # fmt: skip
            window = arch.window(layer)
            sinks = self.softmax_offset if arch.attention_sinks else None

            def causal(q, k, v, allowed=None, before=0):
                # `before`: k and v start with that many keys of a shared prefix, all of them before every query
                if window is not None or (before and (allowed is not None or arch.attn_logit_softcap is not None)):
                    local = _window_mask(q.shape[2], window or before + q.shape[2], q.device, before)
                    allowed = local if allowed is None else allowed & local
                if arch.attn_logit_softcap is not None:
                    if allowed is None:
                        allowed = _window_mask(q.shape[2], q.shape[2], q.device)  # causal
                    return _softcapped_attention(q, k, v, allowed, arch.attn_logit_softcap, **opts)
                width = v.shape[-1]
                if sinks is not None:  # the sink is key 0, which every query sees
                    q, k, v = _sink_key(q, k, v, sinks / opts["scale"])
                    allowed = None if allowed is None else F.pad(allowed, (1, 0), value=True)
                if allowed is not None:
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, **opts)
                elif k.shape[2] > q.shape[2]:
                    # keys before every query (a shared prefix, the sink): causal from the bottom right, as a bias
                    # SDPA's fused kernels take (an explicit mask rules out the flash kernel on CUDA)
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                                         **opts)  # fmt: skip
                else:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **opts)
                return out[..., :width]

            bounds = getattr(packed_seq_params, "bounds", None)
            with self._dropout_rng() if opts["dropout_p"] > 0 else nullcontext():
                if bounds is not None:
                    # split, not slices: a slice's backward writes its grad into a zeroed full-length copy (one per
                    # document, then summed); split's backward is one cat. 3.3 of 13.5 ms per layer at 8 documents.
                    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
                    parts = list(zip(*(t.split(sizes, dim=2) for t in (q, k, v))))
                    continues = getattr(packed_seq_params, "continues", None) or [-1] * len(parts)

                    def document(i: int) -> Tensor:
                        qi, ki, vi = parts[i]
                        if continues[i] < 0:
                            return causal(qi, ki, vi)
                        _, kp, vp = parts[continues[i]]  # the shared prefix: every key of it, then this part's own
                        return causal(qi, torch.cat([kp, ki], dim=2), torch.cat([vp, vi], dim=2),
                                      before=kp.shape[2])  # fmt: skip

                    out = torch.cat([document(i) for i in range(len(parts))], dim=2)
                elif attention_mask is not None:
                    out = causal(q, k, v, ~attention_mask)
                else:
                    out = causal(q, k, v)
            return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

        def _dropout_rng(self):
            """As megatron's core attention: attention dropout draws from the TP RNG tracker (each TP rank's heads
            their own masks), except under sequence parallelism, where the whole block already runs forked."""
            from megatron.core import tensor_parallel

            return nullcontext() if self.config.sequence_parallel else tensor_parallel.get_cuda_rng_tracker().fork()

    return SdpaAttention


def loss_positions(hidden_states: Tensor, labels: Tensor, loss_mask: Tensor,
                   head: Callable[[Tensor, Tensor], Tensor]) -> Tensor:  # fmt: skip
    """Per-token losses [B, L] computed only where `loss_mask` [B, L] is true, zero elsewhere.

    `head(hidden [N, 1, H], labels [1, N]) -> losses [1, N]` is the output layer and cross-entropy, run on the N
    picked positions instead of all B x L: a prompt token's logits (a [vocab] row each, 152k floats for Qwen3) are
    neither computed nor kept for backward. At least one position runs, so the output weight still gets a gradient
    in every backward (the overlapped DP all-reduce waits for every param). Every TP rank picks the same rows.
    """
    rows, length = labels.shape
    index = loss_mask.reshape(-1).nonzero().squeeze(1)
    if index.numel() == 0:
        index = index.new_zeros(1)
    picked = hidden_states.transpose(0, 1).reshape(rows * length, -1).index_select(0, index).unsqueeze(1)
    losses = head(picked, labels.reshape(-1).index_select(0, index).unsqueeze(0))
    zeros = losses.new_zeros(rows * length)
    return zeros.index_copy(0, index, losses[0] * loss_mask.reshape(-1).index_select(0, index).to(losses.dtype)
                            ).view(rows, length)


def rope_angles(inv_freq: Tensor, position_ids: Tensor, longrope: tuple[Tensor, int] | None = None,
                interleaved: bool = False) -> Tensor:  # fmt: skip
    """RoPE angles [S, B, 1, D] in megatron's layout (each frequency for the two halves, or for adjacent pairs when
    `interleaved`) at each token's own position id ([B, S]; positions restart per packed document), on the ids'
    device whatever device `inv_freq` is on.

    `longrope`: (the long factors' inverse frequencies, the original context). A token rotates with them when its
    document is longer than the original context, as transformers picks them for a sequence that long; `inv_freq` then
    holds the short factors'. A document here is a run of positions going up by one, so a part continuing a shared
    prefix counts its prefix (the prefix itself belongs to the part right after it: `tinker_ops.datum_units` keeps
    such units on one side of the original context)."""
    inv = inv_freq.to(position_ids.device)
    if longrope is not None:
        long_inv, original = longrope
        long = (_run_lengths(position_ids) > original).unsqueeze(-1)
        inv = torch.where(long, long_inv.to(position_ids.device), inv)
    freqs = position_ids.unsqueeze(-1).to(inv.dtype) * inv  # [B, S, D / 2]
    angles = torch.stack((freqs, freqs), dim=-1).flatten(-2) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return angles.transpose(0, 1).unsqueeze(2)


def _run_lengths(position_ids: Tensor) -> Tensor:
    """Per token [B, S]: the last position + 1 of its run (positions going up by one; each row starts a new one)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    run = starts.reshape(-1).cumsum(0) - 1
    last = position_ids.new_zeros(run.numel()).scatter_reduce(0, run, position_ids.reshape(-1), "amax")
    return (last[run] + 1).view_as(position_ids)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm (what megatron's local spec builds without TransformerEngine or apex), under a constructor
    that accepts sequence parallelism: its weight is marked `sequence_parallel`, so megatron's `finalize_model_grads`
    sums its grad over TP (each rank normalises its own tokens). megatron's own wrapper refuses sequence
    parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _layer_specs(arch: ModelArch, sequence_parallel: bool = False):
    """megatron's local layer spec (SDPA core attention), per layer: the MoE one on `arch`'s sparse layers (with
    `sequence_parallel`, norms that accept it)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    norm = SequenceParallelRMSNorm if sequence_parallel else None

    def spec(experts: int | None):
        mla = arch.mla is not None  # its latent norms are megatron's q/kv_layernorm
        layer = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                         normalization=_normalization(arch), qk_layernorm=arch.qk_layernorm or mla,
                                         multi_latent_attention=mla)  # fmt: skip
        # SDPA instead of megatron's unfused baddbmm + masked softmax + bmm (same maths, one fused kernel).
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = _sdpa_attention_class(arch)
        if mla:
            from megatron.core.post_training.modelopt.layers import Linear

            layer.submodules.self_attention.module = _packed_latent_attention_class()
            # Not split over TP: megatron's column-parallel path leaves the shared rotated key's gradient summed over
            # the rank's own heads only. Whole on every rank, the key is gathered from the sequence-parallel region
            # (its backward sums every rank's heads) and the weight's grad is summed over TP (`sequence_parallel`):
            # the trainer runs MLA at TP > 1 only so (`sequence_parallel`); without it the forward is still exact.
            attention.linear_kv_down_proj = Linear
        if norm is not None:
            layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
            if mla:
                attention.q_layernorm = attention.kv_layernorm = norm
            elif arch.qk_layernorm:
                attention.q_layernorm = attention.k_layernorm = norm
        return layer

    if not arch.num_experts and norm is None:
        return spec(None)
    dense = spec(None)
    sparse = spec(arch.num_experts) if arch.num_experts else dense
    return TransformerBlockSubmodules(
        layer_specs=[sparse if arch.is_moe(i) else dense for i in range(arch.num_layers)], layer_norm=norm or LayerNormImpl
    )


def _packed_latent_attention_class():
    """megatron's MLASelfAttention computing q, k and v on the ordinary [S, B] path also for packed documents
    (`document_bounds` keeps the "sbhd" format; megatron's MLA would squeeze the batch dim for any packed params):
    only `SdpaAttention` reads the bounds."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class PackedMLASelfAttention(MLASelfAttention):
        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                        packed_seq_params=None, *args, **kwargs):  # fmt: skip
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids, None, *args,
                                                       **kwargs)  # fmt: skip

    return PackedMLASelfAttention


class LatentRope(torch.nn.Module):
    """MLA's RoPE module (what megatron's MLA calls `rotary_pos_emb`): the angles at each token's own position id
    (`rope_angles`, positions restarting per packed document) instead of 0..S-1; with yarn, also the attention factor
    megatron multiplies cos and sin by. No parameters or buffers (the state dict is unchanged)."""

    def __init__(self, inv_freq: Tensor, positions: Callable[[], Tensor], attention_factor: float | None) -> None:
        super().__init__()
        self.inv_freq, self.positions, self.attention_factor = inv_freq, positions, attention_factor

    def get_rotary_seq_len(self, *args: object, **kwargs: object) -> int:
        return 0  # unused: the angles follow the position ids

    def forward(self, seq_len: int, packed_seq: bool = False) -> Tensor | tuple[Tensor, float]:
        angles = rope_angles(self.inv_freq, self.positions())
        return angles if self.attention_factor is None else (angles, self.attention_factor)


def _model_rope(model: torch.nn.Module, arch: ModelArch) -> None:
    """The model's RoPE inverse frequencies as HF computes them for `arch`'s scaling (megatron's table is plain)."""
    if arch.llama3_rope is not None:
        # megatron's own llama3 scaling hard-codes low/high_freq_factor and original_max_position_embeddings.
        model.rotary_pos_emb.inv_freq = llama3_inv_freq(arch)
    if arch.rope_linear_factor is not None:
        model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq / arch.rope_linear_factor
    if arch.yarn_rope is not None:  # its attention_factor: `SdpaAttention`'s scale (arch.attention_scale_factor)
        model.rotary_pos_emb.inv_freq = yarn_inv_freq(arch)
    if arch.longrope is not None:  # its attention factor: `modules.apply_rope_attention_factor`
        short, long, original, _ = arch.longrope
        model.rotary_pos_emb.inv_freq = longrope_inv_freq(arch, short)
        model.longrope = (longrope_inv_freq(arch, long), original)


def _latent_rope(model: torch.nn.Module, arch: ModelArch) -> None:
    """Every MLA layer rotates at the model's current position ids over the rope dims: with the inverse frequencies of
    megatron's plain table (the dense path's too), or with yarn's as transformers computes them."""
    yarn, factor = (yarn_inv_freq(arch), arch.yarn_rope[4]) if arch.yarn_rope else (None, None)
    for layer in model.decoder.layers:
        attention = layer.self_attention
        inv_freq = attention.rotary_pos_emb.inv_freq if yarn is None else yarn
        attention.rotary_pos_emb = LatentRope(inv_freq, lambda: model.current_position_ids, factor)


def build_gpt_model(arch: ModelArch, tp: int, bf16: bool, parallel_output: bool = True, recompute: bool = False,
                    aux_loss_coef: float = 0.0, sequence_parallel: bool = False):  # fmt: skip
    """A megatron-core GPTModel for `arch` on this rank's TP shard (weights uninitialised: load them next)."""
    from megatron.core.models.gpt import GPTModel

    class PackedGPTModel(GPTModel):
        """GPTModel whose RoPE follows `position_ids`, so positions restart at each packed document, and whose output
        layer and cross-entropy run only where `loss_mask` is true when one is given (`loss_positions`)."""

        current_position_ids = None  # read by per-layer RoPE (families.modules.apply_local_rope)
        longrope = None  # (long factors' inverse frequencies, original context) of `longrope` RoPE scaling

        def _preprocess(self, input_ids, position_ids, *args, **kwargs):
            if position_ids is None:  # plain sequences: positions 0..S-1 in every row
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
            self.current_position_ids = position_ids
            out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
            if out[1] is None:
                return out
            inv_freq, interleaved = self.rotary_pos_emb.inv_freq, self.config.rotary_interleaved
            return (out[0], rope_angles(inv_freq, position_ids, self.longrope, interleaved), *out[2:])

        def _postprocess(self, hidden_states, labels=None, loss_mask=None, mtp_in_postprocess=None, **kwargs):
            if loss_mask is None or labels is None or mtp_in_postprocess or self.config.sequence_parallel:
                return super()._postprocess(hidden_states=hidden_states, labels=labels, loss_mask=loss_mask,
                                            mtp_in_postprocess=mtp_in_postprocess, **kwargs)  # fmt: skip
            return loss_positions(hidden_states, labels, loss_mask, lambda h, y: super(PackedGPTModel, self)
                                  ._postprocess(hidden_states=h, labels=y, mtp_in_postprocess=False, **kwargs))

    check_tensor_parallel(arch, tp)
    if arch.num_experts:
        from scalarlm.training.cpu_compat import router_gemm_without_transformer_engine

        router_gemm_without_transformer_engine()
    if arch.mla is not None:
        from scalarlm.training.cpu_compat import latent_attention_without_transformer_engine

        latent_attention_without_transformer_engine()
    model = PackedGPTModel(
        config=transformer_config(arch, tp, bf16, recompute, aux_loss_coef, sequence_parallel),
        transformer_layer_spec=_layer_specs(arch, sequence_parallel),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_fraction,
        rotary_base=arch.rope_theta,
    )
    if arch.mla is not None:
        _latent_rope(model, arch)
    else:
        _model_rope(model, arch)
    model.embedding.embedding_dropout.p = arch.embedding_dropout  # megatron's own is the hidden dropout
    adapt(model, arch, torch.bfloat16 if bf16 else torch.float32, rope_angles)
    if arch.moe_sigmoid:
        _expert_bias_as_parameters(model)
    if arch.num_experts and arch.linear_bias:
        _expert_outputs_own_storage(model)
    if arch.expert_shard[1] > 1:
        _pad_to_the_group(model, [layer.mlp for layer in model.decoder.layers if arch.is_moe(layer.layer_number - 1)])
    return model


def _expert_outputs_own_storage(model: torch.nn.Module) -> None:
    """Each expert's down projection returns a copy of its output. megatron-core 0.16.1's MLP adds an expert's
    bias (times its routing probability) to that output in place, and at one TP rank the row-parallel reduce returns
    its input as is, a view autograd refuses to see modified ("is a view and is being modified inplace"): backward
    through a biased expert (GPT-OSS's) would fail. A copy of [tokens, hidden] per expert."""
    for layer in model.decoder.layers:
        experts = getattr(getattr(layer.mlp, "experts", None), "local_experts", ())
        for expert in experts:
            expert.linear_fc2.register_forward_hook(lambda module, args, out: (out[0].clone(), *out[1:]))


def _expert_bias_as_parameters(model: torch.nn.Module) -> None:
    """megatron keeps a router's `expert_bias` as a buffer; the checkpoint holds it (HF's `e_score_correction_bias`),
    so it becomes a frozen fp32 parameter: loading, export and resume read and write it as every other weight.
    Nothing moves it, as in transformers: the router no longer counts tokens per expert (megatron-core 0.16.1's count
    fails under a padding mask: it ands a [T, E] map with a [T] mask) and `finalize_model_grads` no longer updates
    it (the config flag is off once the routers hold their bias; routing reads `router.expert_bias` either way)."""
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None and router.expert_bias is not None:
            bias = router._buffers.pop("expert_bias")
            router.expert_bias = torch.nn.Parameter(bias.float(), requires_grad=False)
            router.enable_expert_bias = False
    model.config.moe_router_enable_expert_bias = False


def half_precision(model: torch.nn.Module) -> torch.nn.Module:
    """megatron's bf16 wrapper (`Float16Module`, which casts every weight), the routers' fixed expert bias kept in
    fp32 as loaded (transformers keeps `e_score_correction_bias` fp32 too: bf16 would move near-tied expert choices)."""
    from megatron.core.transformer.module import Float16Module

    fp32 = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("router.expert_bias")}
    half = Float16Module(model.config, model)
    params = dict(model.named_parameters())
    for name, value in fp32.items():
        params[name].data = value
    return half


def _pad_to_the_group(model: torch.nn.Module, moes: list[torch.nn.Module]) -> None:
    """Expert parallelism with the allgather dispatcher needs every rank of the expert group to send as many tokens:
    a packed micro-batch ([T, 1]) is padded with zero tokens to the group's longest and the output cut back.

    Exact: the padding's outputs are dropped, so it adds no gradient, and the padding mask keeps it out of the
    load-balancing loss. Every MoE layer of one forward pass sees the same tokens, so the group's longest is asked
    once per pass (one all-reduce and one host sync, not one per layer; a recomputed layer asks none):
    `model.length_syncs` counts the asks.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    longest: dict[int, int] = {}  # this forward pass's local token count -> the group's longest
    model.length_syncs = 0
    model.register_forward_pre_hook(lambda *_: longest.clear())

    def group_length(hidden_states: Tensor) -> int:
        local = hidden_states.shape[0]
        if local not in longest:
            length = torch.tensor([local], dtype=torch.int64, device=hidden_states.device)
            dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
            longest[local] = int(length)
            model.length_syncs += 1
        return longest[local]

    for moe in moes:
        _pad_moe(moe, group_length)


def _pad_moe(moe: torch.nn.Module, group_length: Callable[[Tensor], int]) -> None:
    inner = moe.forward

    def forward(hidden_states: Tensor, *args, padding_mask: Tensor | None = None, **kwargs):
        pad = group_length(hidden_states) - hidden_states.shape[0]
        if pad == 0:
            return inner(hidden_states, *args, padding_mask=padding_mask, **kwargs)
        seq, batch = hidden_states.shape[:2]
        padded = torch.cat([hidden_states, hidden_states.new_zeros(pad, *hidden_states.shape[1:])])
        # megatron's padding mask: [batch, seq], True on padding (what its router code reads; its docstring says the
        # opposite). A micro-batch's own (`losses.token_losses` pads for sequence parallelism) comes first.
        padding = (torch.arange(seq + pad, device=padded.device) >= seq).expand(batch, -1)
        if padding_mask is not None:
            padding = torch.cat([padding_mask.bool(), padding[:, seq:]], dim=1)
        out, bias = inner(padded, *args, padding_mask=padding, **kwargs)
        return out[: hidden_states.shape[0]], bias

    moe.forward = forward


def yarn_inv_freq(arch: ModelArch) -> Tensor:
    """RoPE inverse frequencies of `rope_type: yarn`, computed as transformers does: each frequency blends the
    original (extrapolated) and the factor-interpolated one along a linear ramp between the correction dimensions of
    beta_fast and beta_slow rotations over the original context."""
    factor, beta_fast, beta_slow, old_len, _, truncate = arch.yarn_rope  # type: ignore[misc]
    dim, base = arch.rotary_dim, arch.rope_theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def longrope_inv_freq(arch: ModelArch, factors: tuple[float, ...]) -> Tensor:
    """RoPE inverse frequencies of `rope_type: longrope` with one set of per-frequency factors (short or long), over
    the rotated dims, computed as transformers does."""
    dim = arch.rotary_dim
    base = arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)


def llama3_inv_freq(arch: ModelArch) -> Tensor:
    """RoPE inverse frequencies of `rope_type: llama3`, computed from the config as transformers does."""
    factor, low, high, old_len = arch.llama3_rope  # type: ignore[misc]
    dim = arch.rotary_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
