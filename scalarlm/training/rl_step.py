"""One GRPO / Dr. GRPO optimizer step of a Trainer over a batch of scored rows (all groups in this one step)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from scalarlm.training.grpo import encode_rl_rows, grpo_objective, parse_rl_rows, rl_micro_batches, token_weights
from scalarlm.training.lora import adapters_disabled
from scalarlm.training.losses import token_losses

if TYPE_CHECKING:
    from scalarlm.training.loop import Trainer

# Rows per forward pass in an RL step (at least; `batch_size` if larger): one row per block, no packing.
MIN_ROWS_PER_MICRO = 8


def _reference_logp(trainer: "Trainer", batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Per-token logprobs of the frozen reference: the base (adapters off) or the frozen full-weight copy."""
    with torch.no_grad():
        if trainer.lora:
            with adapters_disabled(trainer.model):
                return -token_losses(trainer.ddp, batch).float()
        return -token_losses(trainer.ref_model, batch).float()


def grpo_step(trainer: "Trainer", raw_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Validate, tokenize and take one optimizer step on `raw_rows`; return the metrics row (InvalidRequest if bad)."""
    start = time.perf_counter()
    args, par = trainer.args, trainer.par
    rows = parse_rl_rows(raw_rows)
    docs, stats = encode_rl_rows(trainer.tokenizer, rows, args.loss, trainer.max_len)
    weights = token_weights(docs, args.loss)
    mine = list(range(par.dp_rank, len(docs), par.dp_size))
    micro = rl_micro_batches(
        [docs[i] for i in mine], [weights[i] for i in mine], max(args.batch_size, MIN_ROWS_PER_MICRO), trainer.pad_id
    )
    use_ref = args.kl_coef > 0
    trainer.ddp.train()
    trainer.optimizer.zero_grad()
    sums = torch.zeros(4, dtype=torch.float64, device=par.device)  # loss, clipped tokens, tokens, kl sum
    for mb in micro:
        mb = mb.to(par.device)
        ref = _reference_logp(trainer, mb.batch) if use_ref else None
        logp = -token_losses(trainer.ddp, mb.batch).float()
        loss, st = grpo_objective(
            logp, mb.old_logprobs, mb.has_old, mb.advantages, mb.weights, mb.batch.loss_mask,
            args.clip_eps, args.kl_coef, ref,
        )  # fmt: skip
        loss.backward()
        sums += torch.stack(
            [loss.detach().double(), st["clipped_tokens"].double(), st["tokens"].double(),
             st.get("kl_sum", torch.zeros(())).double().to(par.device)]
        )  # fmt: skip
    lr, grad_norm = trainer.optimizer_step()
    if par.dp_size > 1:
        dist.all_reduce(sums, group=par.dp_group)
    trainer.step += 1
    tokens = sum(len(d.doc.tokens) for d in docs)
    trainer.tokens_seen += tokens
    loss, clipped, n_tokens, kl_sum = (float(x) for x in sums)
    elapsed = time.perf_counter() - start
    metrics = {
        "step": trainer.step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "loss_tokens": int(n_tokens),
        "clip_fraction": clipped / n_tokens if n_tokens else 0.0,
        "tokens_per_second": tokens / elapsed if elapsed > 0 else 0.0,
        "step_seconds": elapsed,
        "tokens_seen": trainer.tokens_seen,
        "time": time.time(),
        **stats,
    }
    if use_ref:
        metrics["kl"] = kl_sum / n_tokens if n_tokens else 0.0
    return metrics
