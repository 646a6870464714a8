"""Publish the model being trained as an HF checkpoint: gather experts and TP shards, map mcore -> HF, write
atomically."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from scalarlm.checkpoint import JobDir, publish_step
from scalarlm.protocol.training import CheckpointManifest
from scalarlm.training import hf_io
from scalarlm.training.convert import mcore_to_hf, tp_kinds
from scalarlm.training.families import ModelArch, expert_rank, whole_model
from scalarlm.training.families.spec import LOCAL_EXPERTS
from scalarlm.training.parallel import Parallel

logger = logging.getLogger(__name__)


def gather_experts(model: torch.nn.Module, arch: ModelArch, par: Parallel) -> dict[str, Tensor]:
    """This rank's parameters under the whole model's names: with expert parallelism every rank of an EP group
    gathers the group's experts (local expert j of EP rank r is that rank's `local_experts[j]`); collective over
    all ranks."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    if par.ep_size == 1:
        return params
    out = {name: p for name, p in params.items() if LOCAL_EXPERTS not in name}
    held = [expert_rank(whole_model(arch), r, par.ep_size).local_experts for r in range(par.ep_size)]
    for name in sorted(n for n in params if LOCAL_EXPERTS in n):  # the same local names, in order, on each rank
        local = params[name].contiguous()
        parts = [torch.empty_like(local) for _ in range(par.ep_size)]
        dist.all_gather(parts, local, group=par.ep_group)
        head, tail = name.split(LOCAL_EXPERTS)
        j, rest = tail.split(".", 1)
        for r, part in enumerate(parts):
            out[f"{head}{LOCAL_EXPERTS}{held[r][int(j)]}.{rest}"] = part
    return out


def gather_tp_shards(model: torch.nn.Module, arch: ModelArch, par: Parallel) -> list[dict[str, Tensor]] | None:
    """Every TP rank's parameters (on CPU) under the whole model's names, collected on TP rank 0 of DP rank 0;
    None on other ranks. On CPU, TP rank 0's own entries are its live parameters (no copy): write them before the
    next optimizer step, as `publish_checkpoint` does.

    Only the first DP replica takes part in the TP gather (the others hold identical weights); every rank first
    takes part in the expert gather (an EP group spans DP replicas).
    """
    params = gather_experts(model, arch, par)
    if par.dp_rank != 0:
        return None
    arch = whole_model(arch)
    shards: list[dict[str, Tensor]] = [{} for _ in range(par.tp_size)]
    for name in tp_kinds(arch):
        local = params[name].contiguous()
        if par.tp_size == 1:
            parts = [local]
        else:
            parts = [torch.empty_like(local) for _ in range(par.tp_size)]
            dist.all_gather(parts, local, group=par.tp_group)
        if par.tp_rank == 0:
            for r, part in enumerate(parts):
                # On CPU the tensor itself, no copy: `publish_checkpoint` has written it before it returns, so no
                # optimizer step runs meanwhile (a copy cost 16% of a staged publish of the bench's 155 MB model).
                shards[r][name] = part if part.device.type == "cpu" else part.cpu()
    return shards if par.tp_rank == 0 else None


def publish_dtypes(base_model: Path, dtype: str) -> dict[str, torch.dtype] | torch.dtype:
    """The dtypes to publish in: each tensor's dtype in the base checkpoint ("source"), or the one asked for."""
    return hf_io.source_dtypes(base_model) if dtype == "source" else hf_io.PUBLISH_DTYPES[dtype]


def keep_source_names(state: dict[str, Tensor], base_model: Path, tied: tuple[str, str] | None,
                      carried: tuple[str, ...] = ()) -> dict[str, Tensor]:  # fmt: skip
    """Add the base tensors no rule produces, so a published step has the base's tensor names: a tied model's saved
    `lm_head.weight` (= the trained embedding; `tied`: those two names), derived buffers (`rotary_emb.inv_freq`) and a
    multimodal checkpoint's tensors around its text model (names starting with `carried`), both copied unchanged."""
    extra = sorted(hf_io.tensor_names(base_model) - set(state))
    if not extra:
        return state
    out = dict(state)
    with hf_io.Weights(base_model, dtype=None) as base:
        for name in extra:
            if tied is not None and name == tied[0]:
                out[name] = state[tied[1]].clone()
            elif name.endswith(".rotary_emb.inv_freq") or (carried and name.startswith(carried)):
                out[name] = base[name]
            else:
                logger.warning("base tensor %s has no trained counterpart: not published", name)
    return out


def publish_checkpoint(
    job: JobDir,
    model: torch.nn.Module,
    arch: ModelArch,
    par: Parallel,
    base_model: Path,
    base_config: dict[str, Any],
    manifest: CheckpointManifest,
    dtype: str = "source",
    publish: Callable[[JobDir, CheckpointManifest, Callable[[Path], None]], Path] = publish_step,
) -> Path | None:
    """Collectively publish `checkpoints/step-<N>/` in HF format (the base's tensor names, in `dtype`: "source"
    keeps each tensor's base dtype); rank 0 writes it with `publish` (`publish_step`, or a staging publisher's) and
    returns its path."""
    shards = gather_tp_shards(model, arch, par)
    path = None
    if par.is_main and shards is not None:
        state = keep_source_names(mcore_to_hf(shards, whole_model(arch)), base_model,
                                  (arch.hf_head, arch.hf_embedding) if arch.tied_embeddings else None, arch.carried)
        dtypes = publish_dtypes(base_model, dtype)
        path = publish(job, manifest, lambda d: hf_io.write_checkpoint(d, state, base_model, base_config, dtypes))
        logger.info("published %s", path)
    dist.barrier()
    return path
