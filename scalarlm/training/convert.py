"""HF <-> megatron-core weights for every family, with tensor-parallel split and merge.

The family's rules (`families.rules`) say which HF tensors make each megatron parameter; `families.layouts` does
the fusing and sharding. Strict: an HF tensor no rule maps is an error naming it (it would otherwise be dropped),
as is a missing one. HF -> mcore -> HF is bit-exact.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families import ModelArch, hf_tensor_names, rules
from scalarlm.training.families import layouts
from scalarlm.training.families.spec import Kind, check_tensor_names, entry_view, unstacked

__all__ = ["hf_tensor_names", "hf_to_mcore", "mark_tensor_parallel", "mcore_to_hf", "tp_kinds"]


def _check_tied_head(hf: dict[str, Tensor], arch: ModelArch) -> None:
    head = hf.get(arch.hf_head)
    if arch.tied_embeddings and head is not None and not torch.equal(head, hf[arch.hf_embedding]):
        raise InvalidRequest(f"tie_word_embeddings=true but {arch.hf_head} differs from the embedding", param="model")


def _source(hf: Mapping[str, Tensor], name: str) -> Tensor:
    """A rule's source tensor: `hf[name]`, or the entry of a stacked tensor `name` names (`spec.stacked`) when `hf`
    holds the whole stacked tensor."""
    if name in hf:
        return hf[name]
    tensor, index = unstacked(name)
    return hf[tensor] if index is None else layouts.view_entry(hf[tensor][index], entry_view(name))


def hf_to_mcore(hf: Mapping[str, Tensor], arch: ModelArch, tp_rank: int = 0, tp: int = 1) -> dict[str, Tensor]:
    """Megatron parameters of TP rank `tp_rank` (of `tp`) from an HF state dict (every tensor must be mapped)."""
    check_tensor_names(arch, set(hf))
    _check_tied_head(hf, arch)
    out = {}
    for rule in rules(arch):
        full = layouts.to_mcore(rule.kind, [_source(hf, name) for name in rule.hf], arch)
        out[rule.mcore] = layouts.shard(full, rule.kind, tp_rank, tp).contiguous()
    return out


def mcore_to_hf(shards: list[dict[str, Tensor]], arch: ModelArch) -> dict[str, Tensor]:
    """An HF state dict from the megatron parameters of every TP rank (`shards[r]` is rank r's); the entries of a
    stacked tensor are stacked back (every entry must be there: `arch` holds every expert)."""
    out: dict[str, Tensor] = {}
    entries: dict[str, dict[int, dict[str, Tensor]]] = {}  # stacked tensor -> entry -> view -> tensor
    for rule in rules(arch):
        full = layouts.unshard([s[rule.mcore] for s in shards], rule.kind)
        for name, tensor in zip(rule.hf, layouts.to_hf(rule.kind, full, arch, len(rule.hf)), strict=True):
            tensor_name, index = unstacked(name)
            if index is None:
                out[name] = tensor.contiguous()
            else:
                entries.setdefault(tensor_name, {}).setdefault(index, {})[entry_view(name)] = tensor
    for name, parts in entries.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"{name}: stacked tensor entries {sorted(parts)} are not 0..n-1 (every expert needed)")
        out[name] = torch.stack([layouts.unview_entry(parts[i]) for i in range(len(parts))]).contiguous()
    return out


def tp_kinds(arch: ModelArch) -> dict[str, Kind]:
    """How each megatron parameter is split across TP ranks (used when gathering for export)."""
    return {rule.mcore: rule.kind for rule in rules(arch)}


def mark_tensor_parallel(model: torch.nn.Module, arch: ModelArch) -> None:
    """Tag TP-sharded parameters the way megatron does at initialisation.

    megatron-core 0.16.1 skips the tags when weights are created on CPU without initialisation (they are loaded
    from HF right after); grad-norm clipping needs them to count replicated parameters once.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    params = dict(model.named_parameters())
    for name, kind in tp_kinds(arch).items():
        param = params[name]
        if kind != "replicated" and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, 1 if kind == "dim1" else 0, 1)
