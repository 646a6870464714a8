"""The layer pieces megatron-core 0.16.1 lacks, applied to a built GPTModel by small ordered functions (torch).

Each is driven by one `ModelArch` field, never by the model type (Gemma 2/3, OLMo 2/3, Granite, Phi need them today):
`norm_offset` swaps every norm for the zero-centred one: RMSNorm's `x_hat * (1 + w)` computed in fp32, or with
`layer_norm` LayerNorm's (Nemotron's LayerNorm1P); `norm_bias` False for a LayerNorm without a bias, in fp32
(Cohere); `parallel_block` feeds the MLP the layer's input, normed by attention's norm (Cohere) or its own
(`parallel_mlp_norm`: GPT-NeoX); `input_norms` False removes the norms before attention and the MLP;
`qk_norm_over_projection` normalises q and k over every head at once (summing the squares over TP); `qk_norm_per_head`
gives each head's q/k LayerNorm its own weight (Command R+); `activation` "xielu"
gives each MLP its own learned activation (Apertus); `qk_norm_after_rope` moves the q/k norms after RoPE (HunYuan);
`sandwich_norms` adds an output norm after attention and after the MLP; `residual_multiplier` scales each block's output
before the residual add; `embedding_multiplier` scales the embeddings; `output_bias` gives the output layer a bias
(Phi); `logits_divisor` divides the output logits;
`local_rope_theta` gives the sliding-window layers their own RoPE base; `longrope` scales q and k's rotated dims by its
attention factor; `final_logit_softcap` soft-caps the logits. Parameter names stay megatron's (plus
`self_attention.post_norm` / `mlp.post_norm`, `mlp.activation_func.*`), so the converter's rules name them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scalarlm.training.families.spec import ModelArch


class FloatRMSNorm(nn.Module):
    """RMSNorm computed in fp32 with the weight applied in fp32, then cast back: `x_hat * w` (HF's Olmo2RMSNorm) or,
    with `offset`, the zero-centred `x_hat * (1 + w)` (HF's Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter((torch.zeros if offset else torch.ones)(hidden_size, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float() if self.offset else self.weight.float())).type_as(x)


class ProjectionRMSNorm(nn.Module):
    """HF's RMSNorm over a whole q or k projection (all heads at once, OLMo 2/3) on megatron's [s, b, heads, d]
    tensors. At TP > 1 a rank holds its heads and their slice of the weight: the sum of squares is all-reduced over
    TP (differentiably: each rank's loss reaches the sum through its own heads) and divided by the full width."""

    def __init__(self, width: int, tp: int, eps: float, dtype: torch.dtype, group: Any = None) -> None:
        super().__init__()
        self.eps, self.full_width, self.group, self.tp = eps, width, group, tp
        self.weight = nn.Parameter(torch.ones(width // tp, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float().flatten(-2)
        squares = h.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            from torch.distributed.nn.functional import all_reduce

            squares = all_reduce(squares, group=self.group)
        h = h * torch.rsqrt(squares / self.full_width + self.eps)
        return (self.weight.float() * h).type_as(x).view_as(x)


class FloatLayerNorm(nn.Module):
    """LayerNorm over the last dim with a weight and no bias, computed in fp32 with the weight applied in fp32, then
    cast back (HF's CohereLayerNorm). A weight of shape [heads, d] on megatron's [s, b, heads, d] q or k gives each head
    its own (Command R+'s q/k norms; a TP rank holds its heads' rows)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shape, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return (F.layer_norm(x.float(), x.shape[-1:], eps=self.eps) * self.weight.float()).type_as(x)


class ParallelMLPInput(nn.Module):
    """A parallel block's pre-MLP norm: hands the MLP what the layer's input norm gave attention (`normed`, filled by
    a hook on that norm), whatever megatron passes it (x plus attention's output). No parameters."""

    def __init__(self, normed: dict[str, Tensor]) -> None:
        super().__init__()
        self.normed = normed

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.normed.pop("out")


class OffsetLayerNorm(nn.Module):
    """LayerNorm with the zero-centred weight, `layer_norm(x) * (1 + w) + b`, in the input's dtype (HF's
    NemotronLayerNorm1P)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight + 1.0, self.bias, self.eps)


class XIELU(nn.Module):
    """Apertus's activation (HF's XIELUActivation): `alpha_p x^2 + beta x` for x > 0, else
    `(expm1(min(x, eps)) - x) alpha_n + beta x`, with alpha_p = softplus(a_p) and alpha_n = beta + softplus(a_n) from
    the layer's trained scalars; beta and eps are fixed (frozen parameters, so the converter carries them). At TP > 1
    each rank applies it to its slice of the MLP's features: the scalars enter through megatron's copy-to-TP-region,
    whose backward sums their gradients over TP."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.alpha_n = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.beta = nn.Parameter(torch.zeros((), dtype=dtype), requires_grad=False)
        self.eps = nn.Parameter(torch.zeros((), dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        alpha_p = F.softplus(copy_to_tensor_model_parallel_region(self.alpha_p))
        alpha_n = self.beta + F.softplus(copy_to_tensor_model_parallel_region(self.alpha_n))
        negative = (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x
        return torch.where(x > 0, alpha_p * x * x + self.beta * x, negative)


def apply_xielu(model: nn.Module, dtype: torch.dtype) -> None:
    """Each layer's MLP activation becomes its own `XIELU` (megatron's MLP calls `activation_func` on an ungated
    MLP's features)."""
    for layer in model.decoder.layers:
        layer.mlp.activation_func = XIELU(dtype)


def _offset_norm(arch: ModelArch, size: int, dtype: torch.dtype) -> nn.Module:
    if arch.layer_norm:
        return OffsetLayerNorm(size, arch.norm_eps, dtype)
    return FloatRMSNorm(size, arch.norm_eps, dtype, offset=True)


def _own_norm(arch: ModelArch, size: int, dtype: torch.dtype) -> nn.Module:
    """The family's norm where megatron's differs: zero-centred (`norm_offset`) or a LayerNorm without a bias."""
    return _offset_norm(arch, size, dtype) if arch.norm_offset else FloatLayerNorm(size, arch.norm_eps, dtype)


def _float_norm(arch: ModelArch, size: int, dtype: torch.dtype) -> FloatRMSNorm:
    return FloatRMSNorm(size, arch.norm_eps, dtype)


def remove_input_norms(model: nn.Module) -> None:
    """No norm before attention or before the MLP (the output norms stand alone)."""
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in model.decoder.layers:
        layer.input_layernorm = IdentityOp()
        layer.pre_mlp_layernorm = IdentityOp()


def apply_projection_qk_norms(model: nn.Module, arch: ModelArch, dtype: torch.dtype) -> None:
    """q and k normalised over the whole projection. Kept out of megatron's `qk_layernorm` config, whose TP sum of
    the q/k norm grads (`finalize_model_grads`, for weights every rank holds whole) would double these sliced ones."""
    tp = model.config.tensor_model_parallel_size
    group = None
    if tp > 1:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    for layer in model.decoder.layers:
        attn = layer.self_attention
        attn.q_layernorm = ProjectionRMSNorm(arch.num_heads * arch.head_dim, tp, arch.norm_eps, dtype, group)
        attn.k_layernorm = ProjectionRMSNorm(arch.num_kv_heads * arch.head_dim, tp, arch.norm_eps, dtype, group)


def apply_head_qk_norms(model: nn.Module, arch: ModelArch, dtype: torch.dtype) -> None:
    """q and k LayerNorms with a weight per head (`FloatLayerNorm` of [heads, d]), out of megatron's `qk_layernorm`
    config as the projection norms are: each rank's rows are its own heads', whose grads are not summed over TP."""
    tp = model.config.tensor_model_parallel_size
    for layer in model.decoder.layers:
        attn = layer.self_attention
        attn.q_layernorm = FloatLayerNorm((arch.num_heads // tp, arch.head_dim), arch.norm_eps, dtype)
        attn.k_layernorm = FloatLayerNorm((arch.num_kv_heads // tp, arch.head_dim), arch.norm_eps, dtype)


def apply_qk_norms_after_rope(model: nn.Module) -> None:
    """The per-head q/k norms move into the core attention, which applies them to the rotated q and k (megatron's
    attention applies them before RoPE). They keep their `q_layernorm` / `k_layernorm` names, by which megatron sums
    their gradients over TP."""
    for layer in model.decoder.layers:
        attn = layer.self_attention
        core = attn.core_attention
        core.q_layernorm, core.k_layernorm = attn.q_layernorm, attn.k_layernorm
        attn.q_layernorm = attn.k_layernorm = None


def apply_own_norms(model: nn.Module, arch: ModelArch, dtype: torch.dtype) -> None:
    """Every norm (layers, q/k, final) becomes the family's own (`_own_norm`)."""
    for layer in model.decoder.layers:
        layer.input_layernorm = _own_norm(arch, arch.hidden_size, dtype)
        layer.pre_mlp_layernorm = _own_norm(arch, arch.hidden_size, dtype)
        attn = layer.self_attention
        if arch.qk_layernorm:
            attn.q_layernorm = _own_norm(arch, arch.head_dim, dtype)
            attn.k_layernorm = _own_norm(arch, arch.head_dim, dtype)
    model.decoder.final_layernorm = _own_norm(arch, arch.hidden_size, dtype)


def apply_parallel_blocks(model: nn.Module, own_mlp_norm: bool) -> None:
    """The MLP reads the layer's input instead of megatron's x + attention: through attention's norm (what attention
    read: `(x + attn(norm(x))) + mlp(norm(x))`, Cohere's) or, with `own_mlp_norm`, through its own pre-MLP norm
    (`(x + attn(norm1(x))) + mlp(norm2(x))`, GPT-NeoX's parallel residual); megatron's MLP residual is x + attention.
    A hook on the input norm keeps what the MLP needs for the layer's next call (a recomputed forward refills it)."""
    for layer in model.decoder.layers:
        kept: dict[str, Tensor] = {}
        if own_mlp_norm:
            def keep_input(module: nn.Module, args: tuple, kept: dict[str, Tensor] = kept) -> None:
                kept["x"] = args[0]

            def layer_input(module: nn.Module, args: tuple, kept: dict[str, Tensor] = kept) -> tuple:
                return (kept.pop("x"),)

            layer.input_layernorm.register_forward_pre_hook(keep_input)
            layer.pre_mlp_layernorm.register_forward_pre_hook(layer_input)
            continue

        def keep(module: nn.Module, args: tuple, output: Tensor, kept: dict[str, Tensor] = kept) -> None:
            kept["out"] = output

        layer.input_layernorm.register_forward_hook(keep)
        layer.pre_mlp_layernorm = ParallelMLPInput(kept)


def _normed_output(module: nn.Module, args: tuple, output: Any) -> Any:
    out, bias = output
    return module.post_norm(out), bias


def apply_sandwich_norms(model: nn.Module, arch: ModelArch, dtype: torch.dtype) -> None:
    """An output norm after attention and after the MLP, before each residual add."""
    norm = _offset_norm if arch.norm_offset else _float_norm
    for layer in model.decoder.layers:
        for module in (layer.self_attention, layer.mlp):
            module.post_norm = norm(arch, arch.hidden_size, dtype)
            module.register_forward_hook(_normed_output)


def apply_embedding_multiplier(model: nn.Module, arch: ModelArch) -> None:
    """Scale the embeddings (in their dtype, as HF does)."""
    scale = arch.embedding_multiplier

    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return output * torch.tensor(scale, dtype=output.dtype)

    model.embedding.register_forward_hook(hook)


def apply_local_rope(model: nn.Module, arch: ModelArch, rope_angles) -> None:
    """Sliding-window layers rotate with RoPE base `local_rope_theta` (global layers keep the model's)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    local = RotaryEmbedding(kv_channels=arch.head_dim, rotary_percent=arch.rotary_fraction,
                            rotary_base=arch.local_rope_theta, use_cpu_initialization=True)  # fmt: skip

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("rotary_pos_emb") is None:
            return args, kwargs
        angles = rope_angles(local.inv_freq, model.current_position_ids, interleaved=arch.rotary_interleaved)
        return args, {**kwargs, "rotary_pos_emb": angles}

    for i, layer in enumerate(model.decoder.layers):
        if arch.uses_local_rope(i):
            layer.self_attention.register_forward_pre_hook(hook, with_kwargs=True)


def apply_rope_attention_factor(model: nn.Module, arch: ModelArch) -> None:
    """`longrope`'s attention factor: transformers scales cos and sin by it, which scales the rotated dims of q and k
    (RoPE is linear), so they are scaled as the projection hands them over (after any q/k norm, before RoPE). With
    partial RoPE the passed-through dims keep their scale, so this is not a softmax scale."""
    scale = torch.ones(arch.head_dim)
    scale[: arch.rotary_dim] = arch.longrope[3]  # type: ignore[index]

    for layer in model.decoder.layers:
        attention = layer.self_attention
        inner = attention.get_query_key_value_tensors

        def scaled(*args: Any, inner: Callable = inner, **kwargs: Any) -> tuple:
            query, key, *rest = inner(*args, **kwargs)
            by = scale.to(query.device, query.dtype)
            return (query * by, key * by, *rest)

        attention.get_query_key_value_tensors = scaled


def apply_residual_multiplier(model: nn.Module, arch: ModelArch) -> None:
    """Attention and MLP outputs scaled by `residual_multiplier` before each residual add (after any output norm)."""
    scale = arch.residual_multiplier

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        out, bias = output
        return out * scale, bias

    for layer in model.decoder.layers:
        for module in (layer.self_attention, layer.mlp):
            module.register_forward_hook(hook)


def apply_output_bias(model: nn.Module, dtype: torch.dtype) -> None:
    """A bias on the output layer (megatron builds it without): this TP rank's vocabulary's, added by the layer."""
    layer = model.output_layer
    layer.bias = nn.Parameter(torch.zeros(layer.output_size_per_partition, dtype=dtype))


def apply_logits_divisor(model: nn.Module, arch: ModelArch) -> None:
    """Output logits divided by `logits_divisor` (element-wise: also on a TP rank's vocabulary shard)."""
    divisor = arch.logits_divisor

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        logits, bias = output
        return logits / divisor, bias

    model.output_layer.register_forward_hook(hook)


def apply_final_softcap(model: nn.Module, arch: ModelArch) -> None:
    """Output logits become `cap * tanh(logits / cap)` (element-wise, so also on a TP rank's vocabulary shard), before
    the loss reads them."""
    cap = arch.final_logit_softcap

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        logits, bias = output
        return torch.tanh(logits / cap) * cap, bias

    model.output_layer.register_forward_hook(hook)


def adapt(model: nn.Module, arch: ModelArch, dtype: torch.dtype, rope_angles) -> None:
    """Apply what `arch` needs beyond megatron's local layer spec, in order."""
    if not arch.input_norms:
        if not arch.sandwich_norms:
            raise ValueError(f"{arch.family}: a model without input norms needs output norms (sandwich_norms)")
        remove_input_norms(model)
    if arch.qk_norm_over_projection:
        apply_projection_qk_norms(model, arch, dtype)
    if arch.qk_norm_per_head:
        apply_head_qk_norms(model, arch, dtype)
    if arch.norm_offset or (arch.layer_norm and not arch.norm_bias):
        apply_own_norms(model, arch, dtype)
    if arch.parallel_block:
        apply_parallel_blocks(model, arch.parallel_mlp_norm)
    if arch.activation == "xielu":
        apply_xielu(model, dtype)
    if arch.qk_norm_after_rope:
        apply_qk_norms_after_rope(model)
    if arch.sandwich_norms:
        apply_sandwich_norms(model, arch, dtype)
    if arch.residual_multiplier is not None:
        apply_residual_multiplier(model, arch)
    if arch.embedding_multiplier is not None:
        apply_embedding_multiplier(model, arch)
    if arch.local_rope_theta is not None:
        apply_local_rope(model, arch, rope_angles)
    if arch.longrope is not None:
        apply_rope_attention_factor(model, arch)
    if arch.output_bias:
        apply_output_bias(model, dtype)
    if arch.logits_divisor is not None:
        apply_logits_divisor(model, arch)
    if arch.final_logit_softcap is not None:
        apply_final_softcap(model, arch)
