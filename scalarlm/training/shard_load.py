"""This TP rank's megatron parameters, reading only the slices of the HF tensors it holds.

Every TP split the converter makes is, on the HF side, a set of contiguous row (or column) ranges of each source
tensor: "dim0"/"dim1" tensors are chunked on that axis; "qkv" and "fc1" take chunk r of each of q, k, v (gate, up),
which for an HF-fused `qkv_proj` / `gate_up_proj` are consecutive ranges of the one tensor. So the rank reads those
ranges (`hf_io.Weights.read_ranges`), and the converter maps them at TP=1 on the rank's share of the heads: the
result equals `hf_to_mcore(full, arch, tp_rank, tp)` bit for bit (tested). A rule kind this module does not know,
or a split that is not even, falls back to reading whole tensors one at a time.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from scalarlm.training import hf_io
from scalarlm.training.convert import hf_to_mcore, rules

logger = logging.getLogger(__name__)

Ranges = tuple[int, list[tuple[int, int]] | None]  # (axis, row/column ranges; None = the whole tensor)


def _chunk(n: int, tp: int, rank: int) -> tuple[int, int] | None:
    """Rank's part of `n` in `tp` equal parts; None when `n` does not split evenly."""
    if n % tp:
        return None
    size = n // tp
    return rank * size, (rank + 1) * size


def _source_ranges(kind: str, n_sources: int, shape: tuple[int, ...], arch: Any, rank: int, tp: int) -> Ranges | None:
    """What TP rank `rank` needs of one HF source tensor of a rule of `kind`; None if this module cannot say."""
    if kind == "replicated" or tp == 1:
        return 0, None
    axis = 1 if kind == "dim1" else 0
    if kind in ("dim0", "dim1") or n_sources > 1:
        if kind not in ("dim0", "dim1", "qkv", "fc1"):
            return None
        part = _chunk(shape[axis], tp, rank)
        return None if part is None else (axis, [part])
    if kind == "qkv":  # one fused [q; k; v] tensor
        d = arch.head_dim
        sizes = [arch.num_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d]
    elif kind == "fc1":  # one fused [gate; up] tensor
        sizes = [shape[0] // 2, shape[0] // 2]
    else:
        return None
    ranges, offset = [], 0
    for size in sizes:
        part = _chunk(size, tp, rank)
        if part is None:
            return None
        ranges.append((offset + part[0], offset + part[1]))
        offset += size
    return 0, ranges


def _rank_arch(arch: Any, tp: int) -> Any | None:
    """The shape the converter sees for one rank's share of the heads (None if they do not split evenly)."""
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        return None
    return dataclasses.replace(arch, num_heads=arch.num_heads // tp, num_kv_heads=arch.num_kv_heads // tp)


def read_plan(weights: hf_io.Weights, arch: Any, tp_rank: int, tp: int) -> dict[str, Ranges] | None:
    """HF tensor name -> the ranges this rank reads of it; None if some rule cannot be read in slices."""
    plan: dict[str, Ranges] = {}
    for rule in rules(arch):
        for name in rule.hf:
            if name not in weights:
                return None  # let the converter name what is missing
            ranges = _source_ranges(rule.kind, len(rule.hf), weights.shape(name), arch, tp_rank, tp)
            if ranges is None:
                return None
            plan[name] = ranges
    if getattr(arch, "tied_embeddings", False) and arch.hf_head in weights and arch.hf_embedding in plan:
        plan[arch.hf_head] = plan[arch.hf_embedding]  # the converter checks a saved tied head
    return plan


def load_rank_params(
    model_dir: Path, arch: Any, tp_rank: int, tp: int, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, Tensor], dict[str, int]]:
    """Megatron parameters of TP rank `tp_rank` (of `tp`) from the HF checkpoint, and what was read
    (`bytes_read`, `stored_bytes`, `tensors_read`)."""
    with hf_io.Weights(model_dir, dtype) as weights:
        plan = read_plan(weights, arch, tp_rank, tp)
        rank_arch = _rank_arch(arch, tp)
        if plan is None or rank_arch is None:
            logger.warning("cannot read %s in TP slices: reading whole tensors one at a time", model_dir)
            params = hf_to_mcore(weights, arch, tp_rank, tp)  # type: ignore[arg-type]  # a lazy Mapping
        else:
            local = {name: weights.read_ranges(name, axis, ranges) for name, (axis, ranges) in plan.items()}
            params = hf_to_mcore(local, rank_arch, 0, 1)
        stats = {"bytes_read": weights.bytes_read, "stored_bytes": weights.stored_bytes(),
                 "tensors_read": len(weights.reads)}  # fmt: skip
    return params, stats
