"""The layer pieces megatron-core 0.16.1 lacks, applied to a built GPTModel by small ordered functions (torch).

Each is driven by one `ModelArch` field, never by the model type (Gemma 2 and 3 are what need them today):
`norm_offset` swaps every RMSNorm for the zero-centred `x_hat * (1 + w)` one computed in fp32; `sandwich_norms`
adds an output norm after attention and after the MLP; `embedding_multiplier` scales the embeddings;
`local_rope_theta` gives the sliding-window layers their own RoPE base; `final_logit_softcap` soft-caps the logits. Parameter names stay megatron's (plus
`self_attention.post_norm` / `mlp.post_norm`), so the converter's rules name them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from scalarlm.training.families.spec import ModelArch


class OffsetRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight, `x_hat * (1 + w)` in fp32, cast back (HF's Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _offset_norm(arch: ModelArch, size: int, dtype: torch.dtype) -> OffsetRMSNorm:
    return OffsetRMSNorm(size, arch.norm_eps, dtype)


def apply_offset_norms(model: nn.Module, arch: ModelArch, dtype: torch.dtype) -> None:
    """Every RMSNorm (layers, q/k, final) becomes the zero-centred one."""
    for layer in model.decoder.layers:
        layer.input_layernorm = _offset_norm(arch, arch.hidden_size, dtype)
        layer.pre_mlp_layernorm = _offset_norm(arch, arch.hidden_size, dtype)
        attn = layer.self_attention
        if arch.qk_layernorm:
            attn.q_layernorm = _offset_norm(arch, arch.head_dim, dtype)
            attn.k_layernorm = _offset_norm(arch, arch.head_dim, dtype)
    model.decoder.final_layernorm = _offset_norm(arch, arch.hidden_size, dtype)


def _normed_output(module: nn.Module, args: tuple, output: Any) -> Any:
    out, bias = output
    return module.post_norm(out), bias


def apply_sandwich_norms(model: nn.Module, arch: ModelArch, dtype: torch.dtype) -> None:
    """An output norm after attention and after the MLP, before each residual add."""
    norm = _offset_norm if arch.norm_offset else None
    if norm is None:
        raise ValueError("sandwich norms are implemented for zero-centred norms only")
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


def apply_local_rope(model: nn.Module, arch: ModelArch, per_document_rope) -> None:
    """Sliding-window layers rotate with RoPE base `local_rope_theta` (global layers keep the model's)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    model.local_rotary_pos_emb = RotaryEmbedding(
        kv_channels=arch.head_dim, rotary_percent=1.0, rotary_base=arch.local_rope_theta, use_cpu_initialization=True
    )

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("rotary_pos_emb") is None:
            return args, kwargs
        positions = model.current_position_ids
        if positions is None:  # plain sequences: positions 0..S-1 in every row
            hidden = args[0]
            positions = torch.arange(hidden.shape[0], device=hidden.device).expand(hidden.shape[1], -1)
        table = model.local_rotary_pos_emb(int(positions.max()) + 1)
        return args, {**kwargs, "rotary_pos_emb": per_document_rope(table, positions)}

    for i, layer in enumerate(model.decoder.layers):
        if arch.window(i) is not None:
            layer.self_attention.register_forward_pre_hook(hook, with_kwargs=True)


def apply_final_softcap(model: nn.Module, arch: ModelArch) -> None:
    """Output logits become `cap * tanh(logits / cap)` (element-wise, so also on a TP rank's vocabulary shard), before
    the loss reads them."""
    cap = arch.final_logit_softcap

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        logits, bias = output
        return torch.tanh(logits / cap) * cap, bias

    model.output_layer.register_forward_hook(hook)


def adapt(model: nn.Module, arch: ModelArch, dtype: torch.dtype, per_document_rope) -> None:
    """Apply what `arch` needs beyond megatron's local layer spec, in order."""
    if arch.norm_offset:
        apply_offset_norms(model, arch, dtype)
    if arch.sandwich_norms:
        apply_sandwich_norms(model, arch, dtype)
    if arch.embedding_multiplier is not None:
        apply_embedding_multiplier(model, arch)
    if arch.local_rope_theta is not None:
        apply_local_rope(model, arch, per_document_rope)
    if arch.final_logit_softcap is not None:
        apply_final_softcap(model, arch)
