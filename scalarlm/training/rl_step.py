"""GRPO / Dr. GRPO optimizer steps of a Trainer over a batch of scored rows (all groups of the batch in each step).

`rl_batch` tokenizes the rows, leaves out those whose loss has no gradient (advantage 0, when no KL term or trained
load-balancing loss reads their tokens: a group whose completions all scored the same, common with pass/fail rewards,
or a reward at its group's mean) and packs this DP rank's share of the rest padding-free (as SFT's); `grpo_step`
drives one step over it with `step.run_step` and `grpo_loss`: the clipped objective on each micro-batch's logprobs
(the policy forward is the only one, unless a KL term asks for the reference's logprobs too). A GRPO job takes
`num_iterations` steps over each batch (TRL's mu): the first step keeps its logprobs, the ratio of rows without
sampling logprobs in the later steps compares with them, and on a mixture-of-experts model the first step's expert
choices are recorded, compared with and, with `routing_replay`, replayed (`moe_replay`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from scalarlm.training.data import MicroBatch, even_count, pack
from scalarlm.training.grpo import (
    Objective,
    RLDoc,
    RLMicroBatch,
    encode_rl_rows,
    grpo_objective,
    parse_rl_rows,
    prompt_units,
    rank_documents,
    rl_micro_batches,
    shared_prompt_tokens,
    token_weights,
    unit_document,
    with_gradient,
)
from scalarlm.training.lora import adapters_disabled
from scalarlm.training.losses import token_losses
from scalarlm.training.step import LossFn, run_step

if TYPE_CHECKING:
    from scalarlm.training.loop import Trainer

logger = logging.getLogger(__name__)

# Blocks of `max_len` tokens per forward pass in an RL step (at least; `batch_size` if larger).
MIN_ROWS_PER_MICRO = 8
OBJECTIVE_STATS = ("clipped_tokens", "tokens", "kl_sum", "correction_sum", "correction_masked", "off_policy_masked")
STATS = ("loss", *OBJECTIVE_STATS, "routing_changed", "routing_compared")  # summed over micro-batches and ranks


@dataclass
class RLBatch:
    """A batch of scored rows as this rank trains it: its micro-batches, the rows' stats and total tokens (every
    rank), the loss tokens of the rows left out for having no gradient (`grpo.with_gradient`), how many steps have
    trained on it in this run, and the first step's logprobs per micro-batch (kept only when more steps follow)."""

    micro: list[RLMicroBatch]
    stats: dict[str, Any]
    tokens: int
    skipped_loss_tokens: int = 0
    iteration: int = 0
    first_logp: list[Tensor] = field(default_factory=list)


def rl_batch(trainer: "Trainer", raw_rows: list[dict[str, Any]]) -> RLBatch:
    """Validate and tokenize `raw_rows` (InvalidRequest if bad); this DP rank's share, packed."""
    args, par = trainer.args, trainer.par
    rows = parse_rl_rows(raw_rows)
    docs, stats = encode_rl_rows(trainer.tokenizer, rows, args.reward_scaling, trainer.max_len)
    tokens = sum(len(d.doc.tokens) for d in docs)
    weights = token_weights(docs, args.loss, args.max_completion_length, args.mask_truncated_completions)
    skipped = stats["rows_skipped"] = 0
    # Without a trained balance loss the balance meter only reports, over the tokens computed.
    every_token = args.trains_balance_loss
    if args.kl_coef == 0 and not every_token:  # nothing but the clipped objective reads a row's tokens
        docs, weights, stats["rows_skipped"], skipped = with_gradient(docs, weights)
    # Rows with the same prompt compute it once (exact), unless a load-balancing loss counts every row's tokens, or a
    # longrope model's row may pass its original context: the prompt would rotate once for rows needing the short and
    # the long factors (`model.rope_angles`).
    share = not every_token and not (trainer.arch.longrope and trainer.max_len > trainer.arch.longrope[2])
    split = rank_documents([d.doc for d in docs], par.dp_size, trainer.max_len, share)
    ranks = [[docs[i] for i in r] for r in split]
    stats["prompt_tokens_shared"] = sum(_shared_tokens(r, trainer.max_len) for r in ranks) if share else 0
    per_micro = max(args.batch_size, MIN_ROWS_PER_MICRO)
    count = _micro_count(ranks, trainer.max_len, per_micro, share) if par.ep_size > 1 else None
    mine = split[par.dp_rank]
    micro = rl_micro_batches(ranks[par.dp_rank], [weights[i] for i in mine], trainer.max_len, per_micro,
                             trainer.pad_id, count, share)  # fmt: skip
    fillers = sum(m.batch.filler for m in micro)
    if fillers:
        logger.info("expert parallelism: %d filler micro-batch(es) on DP rank %d (%d micro-batches on every rank)",
                    fillers, par.dp_rank, len(micro))  # fmt: skip
    if trainer.routing is not None:
        trainer.routing.new_batch()
    return RLBatch(micro, stats, tokens, skipped_loss_tokens=skipped)


def _shared_tokens(docs: list[RLDoc], max_len: int) -> int:
    """The prompt tokens one rank's `docs` compute once instead of once per row (`grpo.prompt_units`)."""
    plain = [d.doc for d in docs]
    return shared_prompt_tokens(plain, prompt_units(plain, max_len))


def _micro_count(ranks: list[list[RLDoc]], max_len: int, per_micro: int, share: bool) -> int:
    """`data.even_count` over the blocks each DP rank's documents pack into, as `rl_micro_batches` packs them."""
    blocks = []
    for docs in ranks:
        plain = [d.doc for d in docs]
        units = [unit_document(plain, u) for u in prompt_units(plain, max_len)] if share else plain
        blocks.append(len(pack(units, range(len(units)), max_len, packing=True)))
    return even_count(blocks, per_micro)


def _reference_logp(trainer: "Trainer", batch: MicroBatch) -> Tensor:
    """Per-token logprobs of the frozen reference: the base (adapters off) or the frozen full-weight copy."""
    with torch.no_grad():
        if trainer.lora:  # in eval mode, as the frozen copy: no dropout in the reference
            # MoE with routing replay: the base routes on its own choices, never the policy's recorded ones
            paused = trainer.routing.paused() if trainer.routing is not None else nullcontext()
            with adapters_disabled(trainer.model), evaluating(trainer.ddp), paused:
                return -token_losses(trainer.ddp, batch, loss_only=True).float()
        return -token_losses(trainer.ref_model, batch, loss_only=True).float()


@contextmanager
def evaluating(module: torch.nn.Module) -> Iterator[None]:
    """`module` in eval mode for the block, then in the mode it was in."""
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


def grpo_loss(trainer: "Trainer", batch: RLBatch) -> LossFn:
    """The step driver's loss function over `batch`: the weighted objective (+ KL) and its STATS."""
    args, device = trainer.args, trainer.par.device
    keep_first = batch.iteration == 0 and args.num_iterations > 1
    objective = Objective.of(args)

    def loss_fn(i: int, mb: MicroBatch, token_loss: Tensor) -> tuple[Tensor, Tensor]:
        m = batch.micro[i]
        logp = -token_loss.float()
        if keep_first:
            batch.first_logp.append(logp.detach())
        first = batch.first_logp[i] if batch.iteration > 0 else None
        ref = _reference_logp(trainer, mb) if args.kl_coef > 0 else None
        adv, old, has_old, weights = (t.to(device) for t in (m.advantages, m.old_logprobs, m.has_old, m.weights))
        segments = m.segments.to(device) if objective.reads_segments else None
        loss, st = grpo_objective(logp, old, has_old, adv, weights, mb.loss_mask, objective, ref, first, segments)
        zero = torch.zeros((), device=loss.device)
        routing = trainer.routing.take_counts() if trainer.routing is not None else torch.zeros(2)
        stats = torch.stack([loss.detach(), *(st.get(k, zero) for k in OBJECTIVE_STATS),
                             *routing.to(loss.device, loss.dtype)])  # fmt: skip
        return loss, stats.double()

    return loss_fn


def grpo_step(trainer: "Trainer", batch: RLBatch) -> dict[str, Any]:
    """One optimizer step on `batch` (its next iteration); return the metrics row."""
    start = time.perf_counter()
    args = trainer.args
    routing = trainer.routing
    around = routing.forward_pass if routing is not None else None
    try:
        result = run_step(trainer, [m.batch for m in batch.micro], grpo_loss(trainer, batch), len(STATS), around)
    finally:
        if routing is not None:
            routing.done()
    batch.iteration += 1
    tokens, stats = batch.tokens, batch.stats
    trainer.tokens_seen += tokens
    sums = dict(zip(STATS, (float(x) for x in result.sums), strict=True))
    computed = n_tokens = sums["tokens"]
    n_tokens += batch.skipped_loss_tokens  # rows without gradient: in the loss's token count, not computed
    elapsed = time.perf_counter() - start
    metrics = {
        "step": trainer.step,
        "loss": sums["loss"],
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens": tokens,
        "loss_tokens": int(n_tokens),
        "clip_fraction": sums["clipped_tokens"] / n_tokens if n_tokens else 0.0,
        "tokens_per_second": tokens / elapsed if elapsed > 0 else 0.0,
        "step_seconds": elapsed,
        "tokens_seen": trainer.tokens_seen,
        "time": time.time(),
        **stats,
        **result.moe,
    }
    if args.kl_coef > 0:
        metrics["kl"] = sums["kl_sum"] / n_tokens if n_tokens else 0.0
    if args.vllm_importance_sampling_correction and computed:  # over the tokens computed (rows with a gradient)
        metrics["importance_sampling_ratio_mean"] = sums["correction_sum"] / computed
        metrics["importance_sampling_masked_fraction"] = sums["correction_masked"] / computed
    if args.off_policy_mask_threshold is not None and computed:
        metrics["off_policy_masked_fraction"] = sums["off_policy_masked"] / computed
    if args.num_iterations > 1:
        metrics["batch_step"] = (trainer.step - 1) % args.num_iterations + 1  # which of the batch's steps
    if sums["routing_compared"]:
        metrics["moe_routing_changed_fraction"] = sums["routing_changed"] / sums["routing_compared"]
    return metrics
