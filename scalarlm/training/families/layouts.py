"""The only code that fuses, splits and TP-shards megatron's packed tensors (`linear_qkv`, `linear_fc1`).

Pure reshapes (no arithmetic), so HF -> mcore -> HF is bit-exact. Every function takes the `axis` that carries
the output features: 0 for weights and biases, -1 for activations (LoRA deltas use the same code as the weights,
so a layout change cannot silently corrupt adapters).

* q/k/v fuse into `linear_qkv` per KV group: ``[q heads of group g; k_g; v_g]`` for each group g; TP ranks take
  whole groups. HF either holds q/k/v_proj separately or one `qkv_proj` laid out ``[q; k; v]`` (Phi-3).
* gate and up fuse into `linear_fc1` as ``[gate; up]`` (HF `gate_up_proj` already is that); each TP rank holds
  ``[gate_r; up_r]``.
* "dim1" tensors (o_proj / down_proj weights) split on dim 1; "dim0" ones (embeddings, output layer) on dim 0.
* An entry of a stacked tensor is seen through its source name's view (`spec.VIEWS`: `view_entry`), and the views
  of one entry are put back together by `unview_entry` (GPT-OSS's interleaved, transposed experts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from scalarlm.training.families.spec import Kind, ModelArch, VIEWS


def qkv_sizes(arch: ModelArch) -> tuple[int, int, int]:
    """Output features of q, k and v."""
    d = arch.head_dim
    return arch.num_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d


def _split_hf(kind: Kind, parts: Sequence[Tensor], arch: ModelArch, axis: int) -> tuple[Tensor, ...]:
    """HF tensors of one rule as (q, k, v) or (gate, up), un-fusing an HF-fused tensor along `axis`."""
    if len(parts) != 1:
        return tuple(parts)
    if kind == "qkv":
        return tuple(torch.split(parts[0], qkv_sizes(arch), dim=axis))
    return tuple(torch.chunk(parts[0], 2, dim=axis))


def to_mcore(kind: Kind, parts: Sequence[Tensor], arch: ModelArch, axis: int = 0) -> Tensor:
    """The full (all TP ranks) megatron tensor made of the HF tensors `parts` of one rule."""
    if kind == "fc1":
        return torch.cat(_split_hf(kind, parts, arch, axis), dim=axis)
    if kind != "qkv":
        return parts[0]
    q, k, v = (p.movedim(axis, 0) for p in _split_hf(kind, parts, arch, axis))
    g, d = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    grouped = (q.reshape(g, arch.heads_per_group * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(grouped, dim=1).reshape(-1, *tail).movedim(0, axis)


def to_hf(kind: Kind, full: Tensor, arch: ModelArch, n_parts: int, axis: int = 0) -> tuple[Tensor, ...]:
    """Inverse of `to_mcore`: the `n_parts` HF tensors of one rule (1 = HF fuses them) from the full tensor."""
    if kind == "fc1":
        parts = tuple(torch.chunk(full, 2, dim=axis))
    elif kind == "qkv":
        d, hpg = arch.head_dim, arch.heads_per_group
        moved = full.movedim(axis, 0)
        tail = moved.shape[1:]
        grouped = moved.reshape(arch.num_kv_heads, (hpg + 2) * d, *tail)
        parts = tuple(p.reshape(-1, *tail).movedim(0, axis) for p in torch.split(grouped, [hpg * d, d, d], dim=1))
    else:
        return (full,)
    return (torch.cat(parts, dim=axis),) if n_parts == 1 else parts


def shard(full: Tensor, kind: Kind, tp_rank: int, tp: int, axis: int = 0) -> Tensor:
    """This TP rank's slice of a full megatron tensor (`axis` = the output-feature axis)."""
    if kind == "replicated" or tp == 1:
        return full
    if kind == "fc1":
        gate, up = torch.chunk(full, 2, dim=axis)
        return torch.cat([torch.chunk(gate, tp, axis)[tp_rank], torch.chunk(up, tp, axis)[tp_rank]], dim=axis)
    # qkv: whole KV groups are contiguous along the output axis
    return torch.chunk(full, tp, dim=1 if kind == "dim1" else axis)[tp_rank]


def unshard(shards: Sequence[Tensor], kind: Kind) -> Tensor:
    """The full megatron tensor from every TP rank's slice (weights), in rank order."""
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "fc1":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=1 if kind == "dim1" else 0)


def _view_parts(view: str) -> tuple[str, bool]:
    """(which columns: "", "even" or "odd"; whether transposed) of a view (`spec.VIEWS`)."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")
    return view.removesuffix("T").removesuffix("."), view.endswith("T")


def view_entry(entry: Tensor, view: str) -> Tensor:
    """`entry` (one entry of a stacked tensor) seen through `view` (`spec.VIEWS`)."""
    columns, transposed = _view_parts(view)
    if columns:
        entry = entry[..., ("even", "odd").index(columns)::2]
    return entry.transpose(0, 1) if transposed else entry


def unview_entry(views: dict[str, Tensor]) -> Tensor:
    """The stored entry from its views (`view_entry`): one whole view ("" or "T"), or its even and odd halves."""
    stored = {}
    for view, t in views.items():
        columns, transposed = _view_parts(view)
        stored[columns] = t.transpose(0, 1) if transposed else t
    if set(stored) == {""}:
        return stored[""]
    if set(stored) != {"even", "odd"}:
        raise ValueError(f"views {sorted(views)} do not make one entry (one whole view, or its even and odd halves)")
    even, odd = stored["even"], stored["odd"]
    out = even.new_empty(*even.shape[:-1], 2 * even.shape[-1])
    out[..., 0::2], out[..., 1::2] = even, odd
    return out
