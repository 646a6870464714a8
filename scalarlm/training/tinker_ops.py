"""Tinker's training primitives on a session Trainer: forward, forward_backward (named per-token losses, gradients
accumulated), optim_step (Adam parameters per call), save_weights_for_sampler (publish a versioned checkpoint), and
save_state / load_state (a named copy of the trainable weights and optimizer state under `tinker/weights/<name>/`,
loaded back into this or another training run of the same shape, with or without the optimizer state).

A request file of a session holds one line `{"op": ..., ...}` for these (a batch of rows otherwise: the older step
protocol, unchanged). Data follows the SDK's `Datum`: `tokens` (the model input, N ids) and `loss_fn_inputs`
(`target_tokens`, `weights`, `logprobs`, `advantages`, each N long: position i scores target i after input[:i+1]).
Losses are sums over tokens, as Tinker's are (its `loss:sum` metric); outputs per datum are the target tokens'
logprobs and the per-token loss. Anything else is refused with InvalidRequest.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scalarlm.checkpoint.jobdir import atomic_write_text
from scalarlm.checkpoint.staging import servable_step
from scalarlm.checkpoint.tinker import MANIFEST, TinkerRunDir
from scalarlm.protocol.errors import Conflict, InvalidRequest, NotFound
from scalarlm.training import lora
from scalarlm.training.data import MicroBatch, balance_units
from scalarlm.training.losses import token_losses
from scalarlm.training.moe_balance import aux_loss_scale
from scalarlm.training.optim import build_optimizer
from scalarlm.training.rl_step import MIN_ROWS_PER_MICRO
from scalarlm.training.step import start_accumulated_sync

if TYPE_CHECKING:
    from scalarlm.training.loop import Trainer

OPS = ("forward", "forward_backward", "optim_step", "save_weights_for_sampler", "save_state", "load_state")

# Inputs each loss needs beyond `target_tokens` (weights default to ones for cross_entropy).
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}


def is_op_request(rows: list[dict[str, Any]]) -> bool:
    """A Tinker primitive (one line with an "op") rather than a batch of rows to take one step on."""
    return len(rows) == 1 and "op" in rows[0]


def _check_datum(tokens: list[int], targets: list[int], vocab: int, index: int) -> None:
    """InvalidRequest unless the datum's inputs and targets are equally long, not empty, in the vocabulary."""
    n = len(tokens)
    if n == 0 or len(targets) != n:
        raise InvalidRequest(f"datum {index}: target_tokens has {len(targets)} entries for {n} input tokens "
                             "(they must be equally long and not empty)", param="data")  # fmt: skip
    bad = [t for t in (*tokens, *targets) if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"datum {index}: token id {bad[0]} is outside the model's vocabulary [0, {vocab})",
                             param="data")  # fmt: skip


def _common(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_length(pairs: list[list[tuple[int, int]]], members: list[int]) -> int:
    """The positions `members` share: the longest common prefix of their (input, target) pairs, leaving each datum at
    least one position of its own; 0 for one datum."""
    if len(members) < 2:
        return 0
    first = pairs[members[0]]
    return min(min(_common(first, pairs[j]), len(pairs[j]) - 1) for j in members)


def unit_tokens(pairs: list[list[tuple[int, int]]], unit: list[int]) -> int:
    """The positions a unit computes: every datum's, its shared ones once."""
    return sum(len(pairs[i]) for i in unit) - (len(unit) - 1) * prefix_length(pairs, unit)


def datum_units(pairs: list[list[tuple[int, int]]], budget: int, long_after: int | None = None) -> list[list[int]]:
    """Datums that run as one shared-prefix document (`data.Document.parts`): those that start with the same
    (input, target) pairs, e.g. the samples of one prompt, as long as adding one does not save fewer positions and the
    unit stays within `budget` tokens; each unit's members ascending. Units in order of their first datum.

    `long_after` (a `longrope` model's original context): a unit's datums are all at most that long or all longer,
    since the shared prefix rotates once, with the short or the long factors (`model.rope_angles`)."""
    units: list[list[int]] = []
    side = (lambda k: len(pairs[k]) > long_after) if long_after is not None else (lambda k: False)
    for i in sorted(range(len(pairs)), key=lambda k: (pairs[k], k)):
        if units:
            unit = units[-1]
            shared, grown = prefix_length(pairs, unit), prefix_length(pairs, unit + [i])
            saves_no_less = grown >= 1 and len(unit) * grown >= (len(unit) - 1) * shared
            if saves_no_less and side(i) == side(unit[0]) and unit_tokens(pairs, unit + [i]) <= budget:
                unit.append(i)
                continue
        units.append([i])
    return sorted((sorted(u) for u in units), key=lambda u: u[0])


def _packed_batch(pairs: list[list[tuple[int, int]]],
                  units: list[list[int]]) -> tuple[MicroBatch, dict[int, torch.Tensor]]:  # fmt: skip
    """`units` end to end in one padding-free [1, T] micro-batch whose labels are the target tokens; a unit of several
    datums is its shared positions once, then each datum's own positions as a part continuing them. Per datum, the
    positions of the row that are its own N positions, in order."""
    tokens: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    bounds: list[int] = []
    continues: list[int] = []
    where: dict[int, torch.Tensor] = {}
    for unit in units:
        shared, base, head = prefix_length(pairs, unit), len(tokens), len(bounds)
        if shared:
            bounds.append(base)
            continues.append(-1)
            tokens += [x for x, _ in pairs[unit[0]][:shared]]
            labels += [y for _, y in pairs[unit[0]][:shared]]
            positions += range(shared)
        for i in unit:
            own = pairs[i][shared:]
            start = len(tokens)
            bounds.append(start)
            continues.append(head if shared else -1)
            tokens += [x for x, _ in own]
            labels += [y for _, y in own]
            positions += range(shared, shared + len(own))
            where[i] = torch.cat([torch.arange(base, base + shared), torch.arange(start, start + len(own))])
    bounds.append(len(tokens))
    row = lambda xs: torch.tensor(xs, dtype=torch.long).unsqueeze(0)  # noqa: E731
    batch = MicroBatch(row(tokens), row(labels), torch.ones(1, len(tokens)), row(positions), None, tuple(bounds),
                       doc_continues=tuple(continues) if any(c >= 0 for c in continues) else None)  # fmt: skip
    return batch, where


def _micro_units(units: list[list[int]], pairs: list[list[tuple[int, int]]], budget: int) -> list[list[list[int]]]:
    """`units` in order, grouped into micro-batches of at most `budget` tokens (a larger unit alone)."""
    out: list[list[list[int]]] = []
    size = 0
    for unit in units:
        cost = unit_tokens(pairs, unit)
        if out and size + cost <= budget:
            out[-1].append(unit)
            size += cost
        else:
            out.append([unit])
            size = cost
    return out


def _input(datum: dict[str, Any], name: str, n: int, index: int, default: float | None = None) -> torch.Tensor:
    values = datum.get("loss_fn_inputs", {}).get(name)
    if values is None:
        if default is None:
            raise InvalidRequest(f"datum {index}: the loss needs loss_fn_inputs[{name!r}]", param="data")
        return torch.full((n,), default)
    if len(values) != n:
        raise InvalidRequest(f"datum {index}: loss_fn_inputs[{name!r}] has {len(values)} entries for {n} tokens",
                             param="data")  # fmt: skip
    return torch.tensor(values, dtype=torch.float32)


def loss_inputs(loss_fn: str, datum: dict[str, Any], n: int, index: int,
                config: dict[str, float]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The per-token inputs `loss_fn` reads from one datum (checked here, so a bad datum is refused on every rank
    before any rank computes). PPO's and CISPO's clip thresholds may be per token (`loss_fn_inputs`
    `clip_low_threshold` / `clip_high_threshold`, as the SDK names them), else `loss_fn_config`'s, else 0.8 / 1.2."""
    if loss_fn == "cross_entropy":
        return {"weights": _input(datum, "weights", n, index, default=1.0)}
    inputs = {"logprobs": _input(datum, "logprobs", n, index), "advantages": _input(datum, "advantages", n, index)}
    if loss_fn in ("ppo", "cispo"):
        for name, default in (("clip_low_threshold", 0.8), ("clip_high_threshold", 1.2)):
            inputs[name] = _input(datum, name, n, index, default=config.get(name, default))
    return inputs


def elementwise_loss(loss_fn: str, logp: torch.Tensor, datum: dict[str, Any], index: int,
                     config: dict[str, float]) -> torch.Tensor:  # fmt: skip
    """The per-token loss of `loss_fn` for one datum (its sum is the datum's loss)."""
    if loss_fn not in LOSS_INPUTS:
        raise InvalidRequest(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(LOSS_INPUTS)}", param="loss_fn")
    return _loss(loss_fn, logp, loss_inputs(loss_fn, datum, logp.shape[0], index, config), config)


def _loss(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]) -> torch.Tensor:
    """The per-token loss of `loss_fn` from a datum's checked inputs (`loss_inputs`)."""
    inputs = {k: v.to(logp.device) for k, v in inputs.items()}
    if loss_fn == "cross_entropy":
        return -logp * inputs["weights"]
    old, adv = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(logp - old)
    if loss_fn == "importance_sampling":
        return -ratio * adv
    if loss_fn in ("ppo", "cispo"):
        clipped = torch.minimum(torch.maximum(ratio, inputs["clip_low_threshold"]), inputs["clip_high_threshold"])
        if loss_fn == "ppo":
            return -torch.minimum(ratio * adv, clipped * adv)
        return -clipped.detach() * logp * adv
    beta = config.get("beta", 0.05)  # dro
    return -(logp * adv - 0.5 * beta * (logp - old) ** 2)


def forward_backward(trainer: "Trainer", request: dict[str, Any], backward: bool) -> dict[str, Any]:
    """Run every datum; with `backward`, add the gradient of the summed loss to the accumulated gradients.

    Datums run packed, up to `rl_step.MIN_ROWS_PER_MICRO` x `max_seq_len` tokens per forward pass (attention within
    each datum); datums that start with the same (input, target) pairs (the samples of one prompt) compute those
    positions once (`datum_units`, `data.Document.parts`): the same logprobs, losses and gradients as one datum at a
    time (a mixture-of-experts model with a trained load-balancing loss runs one datum per forward pass when a
    gradient is taken). Under DP the ranks take whole units, balanced by tokens (`data.balance_units`; grads are
    summed over DP ranks at optim_step, as the loss is a sum) and the outputs are gathered back into request order;
    every rank checks every datum first, so a bad one is refused by all of them alike."""
    loss_fn = request.get("loss_fn", "cross_entropy")
    if loss_fn not in LOSS_INPUTS:
        raise InvalidRequest(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(LOSS_INPUTS)}", param="loss_fn")
    data = request.get("data") or []
    if not data:
        raise InvalidRequest("forward_backward needs at least one datum", param="data")
    config = {k: float(v) for k, v in (request.get("loss_fn_config") or {}).items()}
    vocab = trainer.arch.vocab_size
    pairs = []
    for i, d in enumerate(data):
        targets = list(d.get("loss_fn_inputs", {}).get("target_tokens") or [])
        _check_datum(d["tokens"], targets, vocab, i)
        pairs.append(list(zip(d["tokens"], targets)))
    inputs = [loss_inputs(loss_fn, datum, len(datum["tokens"]), i, config) for i, datum in enumerate(data)]
    start = time.perf_counter()
    par = trainer.par
    # forward alone runs in eval mode: the logprobs the weights give, without the dropout some checkpoints train with
    # (Seed-OSS's), which forward_backward applies as training does
    trainer.ddp.train(backward)
    # Tokens per forward, as a GRPO micro-batch's; a datum per forward pass when a trained balance loss takes its
    # gradient. A forward without backward packs still: routing is per token (top k, no token dropping) and
    # megatron adds the loss only where gradients are enabled, so the logprobs are the same.
    packed = not trainer.args.trains_balance_loss or not backward
    budget = trainer.max_len * MIN_ROWS_PER_MICRO if packed else 0

    def units_of(rows: list[int]) -> list[list[int]]:
        if not packed:
            return [[i] for i in rows]
        long_after = trainer.arch.longrope[2] if trainer.arch.longrope else None
        return [[rows[k] for k in u] for u in datum_units([pairs[i] for i in rows], budget, long_after)]

    if backward and trainer.args.trains_balance_loss:
        # The loss is a sum over tokens: so is each datum's load-balancing loss (megatron's router multiplies it by
        # the forward's tokens), with a backward scale of 1 -- set here, since a GRPO step leaves 1 / its tokens.
        aux_loss_scale(1)
    rows = balance_units(units_of(list(range(len(data)))), partial(unit_tokens, pairs), par.dp_size)[par.dp_rank]
    mine: list[tuple[int, float, dict[str, Any]]] = []
    for group in _micro_units(units_of(rows), pairs, budget):
        batch, where = _packed_batch(pairs, group)
        batch = batch.to(par.device)
        context = torch.enable_grad() if backward else torch.no_grad()
        # Gradients accumulate over any number of calls: the DP all-reduce waits for optim_step (no_sync here).
        with context, trainer.ddp.no_sync():
            logp_row = -token_losses(trainer.ddp, batch).float()[0]
            summed = logp_row.new_zeros(())
            for i, index in where.items():
                logp = logp_row[index.to(logp_row.device)]
                per_token = _loss(loss_fn, logp, inputs[i], config)
                loss = per_token.sum()
                summed = summed + loss
                output = {"logprobs": logp.detach().cpu().tolist(),
                          "elementwise_loss": per_token.detach().cpu().tolist()}
                mine.append((i, float(loss.detach()), output))
            if backward:
                summed.backward()
    mine.sort(key=lambda item: item[0])
    if par.dp_size > 1:
        gathered: list[Any] = [None] * par.dp_size
        dist.all_gather_object(gathered, mine, group=par.dp_group)
        mine = sorted((item for part in gathered for item in part), key=lambda item: item[0])
    total = sum(loss for _, loss, _ in mine)
    outputs = [output for _, _, output in mine]
    if backward:  # the metrics row of the next optim_step reports the loss its gradients came from
        trainer.tinker_pending = getattr(trainer, "tinker_pending", (0.0, 0))
        trainer.tinker_pending = (trainer.tinker_pending[0] + total, trainer.tinker_pending[1] + len(data))
    return {"loss": total, "outputs": outputs, "metrics": {"loss:sum": total},
            "tokens": sum(len(d["tokens"]) for d in data), "step_seconds": time.perf_counter() - start}  # fmt: skip


def set_adam_params(trainer: "Trainer", params: dict[str, Any]) -> float:
    """Apply one call's Adam parameters to the optimizer; return the learning rate."""
    clip = float(params.get("grad_clip_norm", 0.0))
    trainer.optimizer.set_adam(betas=(float(params.get("beta1", 0.9)), float(params.get("beta2", 0.95))),
                               eps=float(params.get("eps", 1e-12)), weight_decay=float(params.get("weight_decay", 0.0)),
                               max_norm=clip if clip > 0 else math.inf)  # fmt: skip
    return float(params.get("learning_rate", 1e-4))


def optim_step(trainer: "Trainer", request: dict[str, Any]) -> dict[str, Any]:
    """Update the weights with the gradients accumulated since the last optim_step, then clear them."""
    par = trainer.par
    lr = set_adam_params(trainer, request.get("adam_params") or {})
    sum_lora = partial_lora_sum(trainer)
    start_accumulated_sync(trainer.ddp)
    grad_norm = trainer.optimizer.step(lr, after_sync=sum_lora)
    trainer.optimizer.zero_grad()
    trainer.step += 1
    if par.dp_size > 1:
        dist.barrier(group=par.dp_group)
    loss, datums = getattr(trainer, "tinker_pending", (0.0, 0))
    trainer.tinker_pending = (0.0, 0)
    return {"loss": loss, "metrics": {"grad_norm": grad_norm, "lr": lr, "datums": datums}, "step": trainer.step}


def partial_lora_sum(trainer: "Trainer") -> Callable[[], None] | None:
    par = trainer.par
    if not trainer.lora:
        return None
    return lambda: lora.allreduce_lora_grads(trainer.model, par.tp_group, par.tp_size)


def save_weights_for_sampler(trainer: "Trainer") -> dict[str, Any]:
    """Publish the current weights as `checkpoints/step-<step>` (once per step) and return that version."""
    newest = servable_step(trainer.job)  # staged or durable
    if newest is None or newest[0] != trainer.step:
        trainer.publish(None)
    return {"loss": None, "metrics": {}, "version": trainer.step}


def _trainable(trainer: "Trainer") -> dict[str, torch.Tensor]:
    """The weights a saved state holds: every trained parameter (LoRA: the adapters; full: all of them)."""
    return {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}


def save_state(trainer: "Trainer", request: dict[str, Any]) -> dict[str, Any]:
    """Collectively save the trainable weights, optimizer state and step as `tinker/weights/<name>/` (every rank
    writes its shard into `.<name>.tmp/`; rank 0 renames it into place once all have, so a reader never sees half)."""
    par, files = trainer.par, TinkerRunDir(trainer.job)
    name = str(request.get("name") or "")
    try:
        final, tmp = files.weights_dir(name), files.weights_tmp_dir(name)
    except ValueError as e:
        raise InvalidRequest(str(e), param="path") from e
    if final.exists() and not request.get("overwrite"):
        raise Conflict(f"a saved state named {name!r} already exists in this run; choose another name or pass "
                       "overwrite=True", param="path")  # fmt: skip
    if par.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    payload = {"params": {k: p.detach().cpu().clone() for k, p in _trainable(trainer).items()},
               "optimizer": trainer.optimizer.state_dict(), "step": trainer.step}  # fmt: skip
    torch.save(payload, tmp / f"rank-{par.rank}.pt")
    dist.barrier()
    if par.is_main:
        args = trainer.args
        manifest = {
            "name": name, "step": trainer.step, "time": time.time(), "base_model": str(trainer.config.base_model),
            "kind": "lora" if trainer.lora else "full",
            "lora_config": args.lora_config.model_dump() if trainer.lora else None,
            "world_size": par.world_size, "tp": par.tp_size, "user_metadata": request.get("user_metadata"),
            "size_bytes": sum(p.stat().st_size for p in tmp.glob("rank-*.pt")),
        }  # fmt: skip
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    dist.barrier()
    return {"loss": None, "metrics": {}, "name": name, "version": trainer.step}


def load_state(trainer: "Trainer", request: dict[str, Any]) -> dict[str, Any]:
    """Load a saved state's weights into this trainer; with `optimizer`, its optimizer state too, else a fresh
    optimizer. Accumulated gradients are dropped. The step (the version counter of published checkpoints) keeps
    counting up either way, so a version never names two different weights."""
    par = trainer.par
    source = trainer.job.root.parent / str(request.get("source") or "")  # relative to jobs/, set by the control plane
    manifest_path = source / MANIFEST
    if not manifest_path.exists():
        raise NotFound(f"no saved state at {request.get('path') or source}", param="path")
    manifest = json.loads(manifest_path.read_text())
    if (manifest["world_size"], manifest["tp"]) != (par.world_size, par.tp_size):
        raise InvalidRequest(f"the saved state was written by {manifest['world_size']} ranks at TP "
                             f"{manifest['tp']}; this trainer runs {par.world_size} ranks at TP {par.tp_size}",
                             param="path")  # fmt: skip
    payload = torch.load(source / f"rank-{par.rank}.pt", map_location="cpu", weights_only=False)
    params = _trainable(trainer)
    saved = payload["params"]
    mismatched = sorted(set(params) ^ set(saved)) or [k for k in params if params[k].shape != saved[k].shape]
    if mismatched:
        raise InvalidRequest(f"the saved state ({manifest['kind']}, LoRA {manifest.get('lora_config')}) does not "
                             f"fit this model's trainable weights (first mismatch: {mismatched[0]}); load it into a "
                             "training client of the same adapter type and LoRA config", param="path")  # fmt: skip
    with torch.no_grad():
        for k, value in saved.items():
            params[k].copy_(value)
    trainer.optimizer.zero_grad()
    if request.get("optimizer"):
        trainer.optimizer.load_state_dict(payload["optimizer"])
    else:
        trainer.optimizer = build_optimizer(trainer.ddp, trainer.args, par, trainer.bf16)
    trainer.tinker_pending = (0.0, 0)
    if par.dp_size > 1 or par.tp_size > 1:
        dist.barrier()
    return {"loss": None, "metrics": {}, "step": trainer.step, "saved_step": int(payload["step"])}


def run_op(trainer: "Trainer", request: dict[str, Any]) -> dict[str, Any]:
    """Dispatch one Tinker primitive."""
    op = request.get("op")
    if trainer.par.ep_size > 1:
        raise InvalidRequest(f"session op {op!r} is not supported at expert_parallel_size > 1 (a datum per rank "
                             "cannot keep an expert group's ranks in step); use expert_parallel_size 1", param="op")
    if op == "forward_backward":
        return forward_backward(trainer, request, backward=True)
    if op == "forward":
        return forward_backward(trainer, request, backward=False)
    if op == "optim_step":
        return optim_step(trainer, request)
    if op == "save_weights_for_sampler":
        return save_weights_for_sampler(trainer)
    if op == "save_state":
        return save_state(trainer, request)
    if op == "load_state":
        return load_state(trainer, request)
    raise InvalidRequest(f"unknown session op {op!r}; ops are {', '.join(OPS)}", param="op")
