"""One GRPO / Dr. GRPO optimizer step of a Trainer over a batch of scored rows (all groups in this one step).

The rows are tokenized, this DP rank's share packed padding-free (as SFT's), and `step.run_step` drives the step with
`grpo_loss`: the clipped objective on each micro-batch's logprobs (the policy forward is the only one, unless a KL
term asks for the reference's logprobs too).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from scalarlm.training.data import MicroBatch
from scalarlm.training.grpo import (
    RLMicroBatch,
    encode_rl_rows,
    grpo_objective,
    parse_rl_rows,
    rl_micro_batches,
    token_weights,
)
from scalarlm.training.lora import adapters_disabled
from scalarlm.training.losses import token_losses
from scalarlm.training.step import LossFn, run_step

if TYPE_CHECKING:
    from scalarlm.training.loop import Trainer

# Blocks of `max_len` tokens per forward pass in an RL step (at least; `batch_size` if larger).
MIN_ROWS_PER_MICRO = 8
STATS = ("loss", "clipped_tokens", "tokens", "kl_sum")


def _reference_logp(trainer: "Trainer", batch: MicroBatch) -> Tensor:
    """Per-token logprobs of the frozen reference: the base (adapters off) or the frozen full-weight copy."""
    with torch.no_grad():
        if trainer.lora:
            with adapters_disabled(trainer.model):
                return -token_losses(trainer.ddp, batch).float()
        return -token_losses(trainer.ref_model, batch).float()


def grpo_loss(trainer: "Trainer", micro: Sequence[RLMicroBatch]) -> LossFn:
    """The step driver's loss function over `micro`: the weighted clipped objective (+ KL) and its STATS."""
    args, device = trainer.args, trainer.par.device

    def loss_fn(i: int, batch: MicroBatch, token_loss: Tensor) -> tuple[Tensor, Tensor]:
        m = micro[i]
        ref = _reference_logp(trainer, batch) if args.kl_coef > 0 else None
        adv, old, has_old, weights = (t.to(device) for t in (m.advantages, m.old_logprobs, m.has_old, m.weights))
        loss, st = grpo_objective(-token_loss.float(), old, has_old, adv, weights, batch.loss_mask, args.clip_eps,
                                  args.kl_coef, ref)  # fmt: skip
        zero = torch.zeros((), device=loss.device)
        stats = torch.stack([loss.detach(), st["clipped_tokens"], st["tokens"], st.get("kl_sum", zero)])
        return loss, stats.double()

    return loss_fn


def grpo_step(trainer: "Trainer", raw_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Validate, tokenize and take one optimizer step on `raw_rows`; return the metrics row (InvalidRequest if bad)."""
    start = time.perf_counter()
    args, par = trainer.args, trainer.par
    rows = parse_rl_rows(raw_rows)
    docs, stats = encode_rl_rows(trainer.tokenizer, rows, args.loss, trainer.max_len)
    weights = token_weights(docs, args.loss)
    mine = list(range(par.dp_rank, len(docs), par.dp_size))
    micro = rl_micro_batches([docs[i] for i in mine], [weights[i] for i in mine], trainer.max_len,
                             max(args.batch_size, MIN_ROWS_PER_MICRO), trainer.pad_id)  # fmt: skip
    result = run_step(trainer, [m.batch for m in micro], grpo_loss(trainer, micro), len(STATS))
    tokens = sum(len(d.doc.tokens) for d in docs)
    trainer.tokens_seen += tokens
    loss, clipped, n_tokens, kl_sum = (float(x) for x in result.sums)
    elapsed = time.perf_counter() - start
    metrics = {
        "step": trainer.step,
        "loss": loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens": tokens,
        "loss_tokens": int(n_tokens),
        "clip_fraction": clipped / n_tokens if n_tokens else 0.0,
        "tokens_per_second": tokens / elapsed if elapsed > 0 else 0.0,
        "step_seconds": elapsed,
        "tokens_seen": trainer.tokens_seen,
        "time": time.time(),
        **stats,
        **result.moe,
    }
    if args.kl_coef > 0:
        metrics["kl"] = kl_sum / n_tokens if n_tokens else 0.0
    return metrics
