"""LoRA on the megatron model, named and exported the way PEFT names Hugging Face modules.

Megatron fuses q/k/v into `linear_qkv` and gate/up into `linear_fc1`; LoRA is defined per HF module the family
declares (``q_proj`` ... ``down_proj``, Phi-3's fused ``qkv_proj`` / ``gate_up_proj``, Granite 4.0's ``input_linear`` /
``output_linear``, StarCoder2's ``c_fc`` / ``c_proj``: what vLLM loads)
as a low-rank delta ``scale * B @ A @ x`` added to the fused output, laid out by `families.layouts` exactly as the
weights are, so the exported A/B are exactly PEFT's ``lora_A`` / ``lora_B`` of the HF module.

Tensor parallelism (kept simple): every rank holds the full A and B (replicated). Column-parallel layers compute
the full delta and keep this rank's slice; row-parallel layers multiply their input shard by A's matching columns and
all-reduce the rank-r product. Dropout (PEFT's `lora_dropout`, on the adapter's input in training mode only) draws
its mask over the full input width on every rank from the same seeded generator and keeps this rank's columns, so a
TP=2 job drops exactly what a TP=1 job does. The gradients of A (all layers) and of B (column layers) are then
partial sums per TP rank and are all-reduced over TP before the optimizer step (`allreduce_lora_grads`); row-parallel B
gradients are already identical on every TP rank. That all-reduce runs after the DP grad sync has finished (the
trainer hands it to `Optimizer.step` as `after_sync`), never while DP bucket all-reduces of the same grads are in
flight.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scalarlm.protocol.training import LoraConfig
from scalarlm.training.families import ModelArch, family_of, layouts
from scalarlm.training.families.spec import Kind, hf_projections, lora_targets


def linears(arch: ModelArch) -> dict[str, tuple[str, tuple[str, ...], Kind]]:
    """megatron linear -> (HF module path inside a layer, the HF modules it fuses, its TP kind)."""
    attn, mlp, down = hf_projections(arch.fused_qkv, arch.fused_gate_up, arch.mlp_names, arch.attention_names)
    module = arch.mlp_names[0]
    attention, _, o_proj = arch.attention_names
    return {
        "self_attention.linear_qkv": (attention, attn, "dim0" if arch.qkv_grouped else "qkv"),
        "self_attention.linear_proj": (attention, (o_proj,), "dim1"),
        "mlp.linear_fc1": (module, mlp, "fc1" if arch.gated_mlp else "dim0"),
        "mlp.linear_fc2": (module, (down,), "dim1"),
    }


class LoraPair(nn.Module):
    """One HF projection's adapter: A [r, in] (PEFT's kaiming init) and B [out, r] (zeros)."""

    def __init__(self, r: int, fan_in: int, fan_out: int, generator: torch.Generator) -> None:
        super().__init__()
        a = torch.empty(r, fan_in)
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) as in PEFT / nn.Linear
        a.uniform_(-bound, bound, generator=generator)
        self.A = nn.Parameter(a)
        self.B = nn.Parameter(torch.zeros(fan_out, r))


class LoraSet(nn.Module):
    """The adapters of one megatron linear (one per fused HF projection it holds that is targeted)."""

    def __init__(self, pairs: dict[str, LoraPair], kind: str, layout: Kind, scale: float, dropout: float,
                 sequence_parallel: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.pairs = nn.ModuleDict(pairs)
        self.kind = kind  # "column" or "row" parallel
        self.layout = layout  # how the fused HF modules sit in megatron's output (families.layouts)
        # The linear runs under sequence parallelism (MoE and MLA models at TP > 1): a column-parallel one's input,
        # and a row-parallel one's output, hold this TP rank's share of the tokens.
        self.sequence_parallel = sequence_parallel
        self.scale = scale
        self.dropout = dropout
        self.enabled = True

    def drop(self, x: Tensor, rank: int = 0, size: int = 1) -> Tensor:
        """`x` (this TP rank's `rank`-th of `size` column shards of the input) with PEFT's dropout applied in training:
        the mask is drawn for the full width and sliced, so every TP layout drops the same input elements."""
        if not self.training or self.dropout == 0:
            return x
        keep = torch.empty(*x.shape[:-1], x.shape[-1] * size, dtype=x.dtype, device=x.device)
        keep.bernoulli_(1 - self.dropout)
        return x * torch.chunk(keep, size, dim=-1)[rank] / (1 - self.dropout)


def _proj_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """(in, out) features of each HF module."""
    h, d = arch.hidden_size, arch.head_dim
    qkv = sum(layouts.qkv_sizes(arch))
    _, fused, down = arch.mlp_names
    _, fused_qkv, o_proj = arch.attention_names
    return {
        fused_qkv: (h, qkv),
        "q_proj": (h, arch.num_heads * d),
        "k_proj": (h, arch.num_kv_heads * d),
        "v_proj": (h, arch.num_kv_heads * d),
        o_proj: (arch.num_heads * d, h),
        "gate_proj": (h, arch.ffn_hidden_size),
        "up_proj": (h, arch.ffn_hidden_size),
        down: (arch.ffn_hidden_size, h),
        fused: (h, (2 if arch.gated_mlp else 1) * arch.ffn_hidden_size),  # [gate; up], or an ungated MLP's input
    }


def _delta(lora: LoraSet, name: str, x: Tensor) -> Tensor:
    pair = lora.pairs[name]
    return (x @ pair.A.t().to(x.dtype)) @ pair.B.t().to(x.dtype) * lora.scale


def _column_delta(lora: LoraSet, projs: tuple[str, ...], x: Tensor, arch: ModelArch, tp: tuple[int, int]) -> Tensor:
    """This TP rank's slice of the fused delta, in megatron's layout (the weights' layout, via `layouts`)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    rank, size = tp
    if lora.sequence_parallel:  # every rank's tokens, as the linear gathers them (backward: reduce-scatter)
        x = lora.drop(gather_from_sequence_parallel_region(x))
    else:
        x = copy_to_tensor_model_parallel_region(lora.drop(x))  # backward: sum the input grads of all TP ranks
    shapes = _proj_shapes(arch)
    lead = x.shape[:-1]
    parts = [_delta(lora, p, x) if p in lora.pairs else x.new_zeros(*lead, shapes[p][1]) for p in projs]
    full = layouts.to_mcore(lora.layout, parts, arch, axis=-1)
    return layouts.shard(full, lora.layout, rank, size, axis=-1)


def _row_delta(lora: LoraSet, proj: str, x: Tensor, tp: tuple[int, int]) -> Tensor:
    """The full delta of a row-parallel linear from this rank's input shard (all-reduced over TP; under sequence
    parallelism reduce-scattered, as the linear's output: this rank's tokens)."""
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    rank, size = tp
    pair = lora.pairs[proj]
    a = torch.chunk(pair.A, size, dim=1)[rank].to(x.dtype)
    partial = lora.drop(x, rank, size) @ a.t()
    if lora.sequence_parallel:
        low = reduce_scatter_to_sequence_parallel_region(partial)
    else:
        low = reduce_from_tensor_model_parallel_region(partial)
    return low @ pair.B.t().to(x.dtype) * lora.scale


def _make_hook(lora: LoraSet, projs: tuple[str, ...], kind: str, arch: ModelArch, tp: tuple[int, int]):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not lora.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        if kind == "column":
            delta = _column_delta(lora, projs, x, arch, tp)
        else:
            delta = _row_delta(lora, projs[0], x, tp)
        return out + delta.to(out.dtype), bias

    return hook


def check_targets(config: LoraConfig, arch: ModelArch) -> list[str]:
    """The targeted HF modules in the family's order; InvalidRequest for names this family cannot place."""
    return lora_targets(family_of(arch), config.target_modules)


def attach_lora(model: nn.Module, arch: ModelArch, config: LoraConfig, tp_rank: int, tp_size: int, seed: int) -> list[LoraSet]:
    """Freeze `model` and add LoRA adapters (identical on every TP rank: seeded init) to the targeted linears."""
    targets = set(check_targets(config, arch))
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed + 1_234_567)
    shapes = _proj_shapes(arch)
    sets = []
    for layer in model.decoder.layers:
        for path, (_, projs, layout) in linears(arch).items():
            chosen = [p for p in projs if p in targets]
            if not chosen:
                continue
            kind = "row" if layout == "dim1" else "column"
            linear = layer.get_submodule(path)
            pairs = {p: LoraPair(config.r, shapes[p][0], shapes[p][1], gen) for p in chosen}
            lora = LoraSet(pairs, kind, layout, config.alpha / config.r, config.dropout,
                           bool(getattr(linear, "sequence_parallel", False)))  # fmt: skip
            device = next(linear.parameters()).device
            lora.to(device)
            linear.lora = lora
            linear.register_forward_hook(_make_hook(lora, projs, kind, arch, (tp_rank, tp_size)), with_kwargs=True)
            sets.append(lora)
    return sets


def recompute_reaches_adapters(model: nn.Module) -> None:
    """Under megatron's full activation recompute each layer is a checkpoint that tracks gradients only when its input
    does, and with the base frozen nothing before the first adapter does: the adapters got no gradient (backward found
    no graph). The embedding's output requires grad instead (HF's `enable_input_require_grads`)."""

    def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
        if torch.is_grad_enabled() and not output.requires_grad:
            output.requires_grad_(True)

    model.embedding.register_forward_hook(hook)


def lora_sets(model: nn.Module) -> list[LoraSet]:
    """Every adapter set attached to `model`."""
    return [m for m in model.modules() if isinstance(m, LoraSet)]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model (the frozen reference for KL) inside the block."""
    sets = lora_sets(model)
    for s in sets:
        s.enabled = False
    try:
        yield
    finally:
        for s in sets:
            s.enabled = True


def allreduce_lora_grads(model: nn.Module, group: dist.ProcessGroup, tp_size: int) -> None:
    """Sum the partial A/B gradients over TP ranks (row-parallel B grads are already complete, unless under sequence
    parallelism: each rank's B then sees only its own tokens).

    With megatron DDP this reduces `main_grad`: call it only after `finish_grad_sync()` (overlapped DP all-reduces of
    those buffers may still be running before it), in the same order on every rank."""
    if tp_size == 1:
        return
    for lora in lora_sets(model):
        for pair in lora.pairs.values():
            params = [pair.A] if lora.kind == "row" and not lora.sequence_parallel else [pair.A, pair.B]
            for p in params:
                grad = getattr(p, "main_grad", None)
                if grad is None:
                    grad = p.grad
                if grad is not None:
                    dist.all_reduce(grad, group=group)


def peft_state(model: nn.Module, arch: ModelArch) -> dict[str, Tensor]:
    """The adapters as PEFT's adapter_model.safetensors keys (fp32 copies on CPU)."""
    out: dict[str, Tensor] = {}
    for i, layer in enumerate(model.decoder.layers):
        modules = dict(layer.named_modules())  # (a mixture-of-experts layer has no mlp.linear_fc1)
        for path, (hf_module, _, _) in linears(arch).items():
            lora = getattr(modules.get(path), "lora", None)
            if lora is None:
                continue
            for proj, pair in lora.pairs.items():
                key = f"base_model.model.{arch.adapter_layers or arch.model_names[1]}.{i}.{hf_module}.{proj}"
                out[f"{key}.lora_A.weight"] = pair.A.detach().float().cpu().contiguous()
                out[f"{key}.lora_B.weight"] = pair.B.detach().float().cpu().contiguous()
    return out


def _carried_modules(arch: ModelArch) -> str | None:
    """PEFT's `exclude_modules` (a regex) for a multimodal model's vision tower and projector, whose attention and MLP
    projections share the text model's names: the adapter targets the text model only (vLLM's LoRA does too)."""
    if not arch.carried:
        return None
    names = sorted({prefix.rstrip(".").split(".")[-1] for prefix in arch.carried})
    return rf"(.*\.)?({'|'.join(names)})\..*"


def peft_config(config: LoraConfig, arch: ModelArch, base_model: str) -> dict[str, Any]:
    """adapter_config.json for PEFT and vLLM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": check_targets(config, arch),
        "exclude_modules": _carried_modules(arch),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_adapter(dest: Path, state: dict[str, Tensor], config: dict[str, Any], base_dir: Path | None = None) -> None:
    """Write adapter_model.safetensors and adapter_config.json into `dest`, with `base_dir`'s tokenizer files (linked,
    `hf_io.copy_support_files`) when given: what a published adapter holds."""
    from safetensors.torch import save_file

    save_file(state, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if base_dir is not None:
        from scalarlm.training.hf_io import copy_support_files

        copy_support_files(base_dir, dest)
