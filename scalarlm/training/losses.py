"""Losses. They see per-token losses and masks only, never the model type.

The SFT loss of a step is the mean cross-entropy over the completion tokens of the *global* batch: each
micro-batch contributes ``sum(token_loss * mask) / global_completion_tokens`` and gradients are summed over
micro-batches and DP ranks, so DP=2 computes exactly what DP=1 computes on the same global batch.
"""

from __future__ import annotations

from torch import Tensor

from scalarlm.training.data import MicroBatch
from scalarlm.training.model import document_bounds


def token_losses(model, batch: MicroBatch) -> Tensor:
    """Per-token cross-entropy [B, L] of `batch` (vocab-parallel under TP, identical on every TP rank)."""
    packed = document_bounds(batch.doc_bounds) if batch.doc_bounds is not None else None
    return model(
        batch.tokens,
        batch.position_ids,
        batch.attention_mask,
        labels=batch.labels,
        packed_seq_params=packed,
    )


def sft_loss(per_token: Tensor, loss_mask: Tensor, global_loss_tokens: int) -> Tensor:
    """This micro-batch's share of the global mean completion-token loss."""
    return (per_token.float() * loss_mask).sum() / max(global_loss_tokens, 1)
