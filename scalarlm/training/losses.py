"""Losses. They see per-token losses and masks only, never the model type.

The SFT loss of a step is the mean cross-entropy over the completion tokens of the *global* batch: each
micro-batch contributes ``sum(token_loss * mask) / global_completion_tokens`` and gradients are summed over
micro-batches and DP ranks, so DP=2 computes exactly what DP=1 computes on the same global batch.
"""

from __future__ import annotations

from torch import Tensor

from scalarlm.training.data import MicroBatch
from scalarlm.training.model import document_bounds


def token_losses(model, batch: MicroBatch, loss_only: bool = False) -> Tensor:
    """Per-token cross-entropy [B, L] of `batch` (vocab-parallel under TP, identical on every TP rank).

    `loss_only`: the caller reads only the positions of `batch.loss_mask` (a step's loss); the output layer and the
    cross-entropy run there alone and every other position is 0 (model.loss_positions). Not under sequence
    parallelism, where each TP rank holds a different part of the sequence.

    Under sequence parallelism the length must divide by TP: the batch runs padded to it (`MicroBatch.padded`) and
    the padding is cut off. megatron's padding mask goes with it, even when nothing is padded: the routers' load
    balancing leaves the padding out, and with a mask megatron 0.16 weighs each rank's part of the aux loss by the
    micro-batch's token count (as at TP=1) instead of the rank's own (half of it at TP=2; measured against TP=1)."""
    config = model.config
    pad, padding = 0, None
    if config.sequence_parallel:
        pad = -batch.tokens.shape[1] % config.tensor_model_parallel_size
        batch, padding = batch.padded(pad)
    packed = document_bounds(batch.doc_bounds, batch.doc_continues) if batch.doc_bounds is not None else None
    out = model(
        batch.tokens,
        batch.position_ids,
        batch.attention_mask,
        labels=batch.labels,
        packed_seq_params=packed,
        padding_mask=padding,
        **({"loss_mask": batch.loss_mask > 0} if loss_only else {}),
    )
    return out[:, : out.shape[1] - pad]


def sft_loss(per_token: Tensor, loss_mask: Tensor, global_loss_tokens: int) -> Tensor:
    """This micro-batch's share of the global mean completion-token loss."""
    return (per_token.float() * loss_mask).sum() / max(global_loss_tokens, 1)
