"""Resume state under `job_dir/state/`: per-rank model shard, optimizer, data cursor and RNG, for exact resume.

Layout: `state/step-<N>/rank-<r>.pt` for every rank, then `state/latest.json` ({"step", "world_size", "tp", "ep"}),
written by rank 0 only after every rank has saved, names the newest complete state. Older step folders are
removed after the pointer moves, so a crash mid-save leaves the previous state intact.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scalarlm.checkpoint.jobdir import atomic_write_text
from scalarlm.training.parallel import Parallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavedState:
    """Where the newest complete resume state is and which layout wrote it."""

    step: int
    world_size: int
    tp: int
    path: Path
    ep: int = 1


def _rng_state(par: Parallel) -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "tracker": get_cuda_rng_tracker().get_states()}
    if par.on_gpu:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any], par: Parallel) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if par.on_gpu and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def latest_state(state_dir: Path) -> SavedState | None:
    """The newest complete resume state, or None."""
    pointer = Path(state_dir) / "latest.json"
    if not pointer.exists():
        return None
    meta = json.loads(pointer.read_text())
    path = Path(state_dir) / f"step-{meta['step']}"
    if not path.is_dir():
        return None
    return SavedState(step=int(meta["step"]), world_size=int(meta["world_size"]), tp=int(meta["tp"]), path=path,
                      ep=int(meta.get("ep", 1)))  # fmt: skip


def save_state(
    state_dir: Path,
    step: int,
    par: Parallel,
    model: torch.nn.Module,
    optimizer: Any,
    extra: dict[str, Any],
) -> None:
    """Collectively save every rank's state for resuming after `step` completed steps."""
    state_dir = Path(state_dir)
    folder = state_dir / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "step": step,
        "model": {k: p.detach().to("cpu", copy=True) for k, p in model.named_parameters()},  # no 2nd copy on a GPU
        "optimizer": optimizer.state_dict(),
        "rng": _rng_state(par),
        **extra,
    }
    tmp = folder / f".rank-{par.rank}.pt.tmp"
    torch.save(payload, tmp)
    tmp.replace(folder / f"rank-{par.rank}.pt")
    dist.barrier()
    if par.is_main:
        meta = {"step": step, "world_size": par.world_size, "tp": par.tp_size, "ep": par.ep_size}
        atomic_write_text(state_dir / "latest.json", json.dumps(meta) + "\n")
        for old in state_dir.glob("step-*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        logger.info("saved resume state at step %d", step)
    dist.barrier()


def load_state(saved: SavedState, par: Parallel, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Restore this rank's model, optimizer and RNG from `saved`; return the payload (data cursor, counters)."""
    if (saved.world_size, saved.tp, saved.ep) != (par.world_size, par.tp_size, par.ep_size):
        raise RuntimeError(
            f"saved state is for {saved.world_size} ranks / TP {saved.tp} / EP {saved.ep}; this job runs "
            f"{par.world_size} ranks / TP {par.tp_size} / EP {par.ep_size}"
        )
    payload = torch.load(saved.path / f"rank-{par.rank}.pt", map_location="cpu", weights_only=False)
    params = dict(model.named_parameters())
    if set(params) != set(payload["model"]):
        raise RuntimeError(f"saved state at {saved.path} does not match the model's parameters")
    with torch.no_grad():
        for name, value in payload["model"].items():
            params[name].copy_(value)
    optimizer.load_state_dict(payload["optimizer"])
    _set_rng_state(payload["rng"], par)
    logger.info("resumed from state at step %d", saved.step)
    return payload
