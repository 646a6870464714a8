"""HF <-> megatron-core weight mapping for the Llama family, with tensor-parallel split and merge.

Pure tensor reshapes (no arithmetic), so HF -> mcore -> HF is bit-exact. Layout facts:

* q/k/v fuse into `linear_qkv` per KV group: ``[q heads of group g; k_g; v_g]`` for each group g; TP ranks
  take whole groups (dim 0). A qkv bias follows the same layout.
* gate and up fuse into `linear_fc1` as ``[gate; up]``; each TP rank holds ``[gate_r; up_r]``.
* o_proj / down_proj split on dim 1 (row-parallel); embeddings and the output layer split on dim 0 (vocab).
* Norms are replicated. A tied model has no output layer (megatron shares the embedding).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from scalarlm.training.model import ModelArch

Kind = Literal["replicated", "dim0", "dim1", "qkv", "fc1"]


@dataclass(frozen=True)
class Rule:
    """One megatron parameter, the HF tensors it is made of, and how it is split across TP ranks."""

    mcore: str
    hf: tuple[str, ...]
    kind: Kind


def rules(arch: ModelArch) -> Iterator[Rule]:
    """Every parameter of the megatron model and its HF source tensors."""
    yield Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "dim0")
    for i in range(arch.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield Rule(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated")
        qkv = tuple(f"{hf}self_attn.{p}_proj.weight" for p in "qkv")
        yield Rule(mc + "self_attention.linear_qkv.weight", qkv, "qkv")
        if arch.qkv_bias:
            qkv_b = tuple(f"{hf}self_attn.{p}_proj.bias" for p in "qkv")
            yield Rule(mc + "self_attention.linear_qkv.bias", qkv_b, "qkv")
        yield Rule(mc + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "dim1")
        yield Rule(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated")
        fc1 = (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
        yield Rule(mc + "mlp.linear_fc1.weight", fc1, "fc1")
        yield Rule(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "dim1")
    yield Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")
    if not arch.tied_embeddings:
        yield Rule("output_layer.weight", ("lm_head.weight",), "dim0")


def hf_tensor_names(arch: ModelArch) -> list[str]:
    """The HF tensor names a checkpoint of `arch` holds (what `mcore_to_hf` produces)."""
    return [name for rule in rules(arch) for name in rule.hf]


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: ModelArch) -> Tensor:
    """[q; k; v] (HF) -> per KV group [q_g; k_g; v_g] (megatron); works for weights and biases."""
    g, d = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    parts = (q.reshape(g, arch.heads_per_group * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _split_qkv(fused: Tensor, arch: ModelArch) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `_fuse_qkv` for the full (all groups) tensor."""
    d, hpg = arch.head_dim, arch.heads_per_group
    tail = fused.shape[1:]
    grouped = fused.reshape(arch.num_kv_heads, (hpg + 2) * d, *tail)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _shard(full: Tensor, kind: Kind, tp_rank: int, tp: int) -> Tensor:
    """This TP rank's slice of a full megatron tensor."""
    if kind == "replicated" or tp == 1:
        return full
    if kind == "fc1":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, 0)[tp_rank], torch.chunk(up, tp, 0)[tp_rank]], dim=0)
    dim = 1 if kind == "dim1" else 0  # qkv: whole KV groups are contiguous along dim 0
    return torch.chunk(full, tp, dim=dim)[tp_rank]


def _unshard(shards: list[Tensor], kind: Kind) -> Tensor:
    """The full megatron tensor from every TP rank's slice, in rank order."""
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "fc1":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if kind == "dim1" else 0)


def hf_to_mcore(hf: dict[str, Tensor], arch: ModelArch, tp_rank: int = 0, tp: int = 1) -> dict[str, Tensor]:
    """Megatron parameters of TP rank `tp_rank` (of `tp`) from an HF state dict."""
    missing = [name for name in hf_tensor_names(arch) if name not in hf]
    if missing:
        raise KeyError(f"HF checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    out = {}
    for rule in rules(arch):
        src = [hf[name] for name in rule.hf]
        if rule.kind == "qkv":
            full = _fuse_qkv(*src, arch)
        elif rule.kind == "fc1":
            full = torch.cat(src, dim=0)
        else:
            full = src[0]
        out[rule.mcore] = _shard(full, rule.kind, tp_rank, tp).contiguous()
    return out


def mcore_to_hf(shards: list[dict[str, Tensor]], arch: ModelArch) -> dict[str, Tensor]:
    """An HF state dict from the megatron parameters of every TP rank (`shards[r]` is rank r's)."""
    out = {}
    for rule in rules(arch):
        full = _unshard([s[rule.mcore] for s in shards], rule.kind)
        if rule.kind == "qkv":
            parts = _split_qkv(full, arch)
        elif rule.kind == "fc1":
            parts = tuple(torch.chunk(full, 2, dim=0))
        else:
            parts = (full,)
        for name, tensor in zip(rule.hf, parts):
            out[name] = tensor.contiguous()
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
