"""`model.loss_positions`: the output layer and cross-entropy only where the loss mask is true."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scalarlm.training.model import loss_positions


def _setup(mask_rows: list[list[bool]]):
    torch.manual_seed(0)
    rows, length, hidden, vocab = len(mask_rows), len(mask_rows[0]), 8, 11
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states = torch.randn(length, rows, hidden, requires_grad=True)  # megatron's [S, B, H]
    labels = torch.randint(0, vocab, (rows, length))
    calls: list[int] = []

    def run(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # [S, B, H], [B, S] -> [B, S]
        calls.append(h.shape[0] * h.shape[1])
        logits = head(h).transpose(0, 1)
        return F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), reduction="none").view(y.shape)

    return head, states, labels, torch.tensor(mask_rows), run, calls


def test_losses_and_gradients_equal_the_full_head_where_the_mask_is_and_zero_elsewhere() -> None:
    head, states, labels, mask, run, calls = _setup([[False, True, True, False, True], [True, False, False, True, True]])
    picked = loss_positions(states, labels, mask, run)
    assert calls == [int(mask.sum())]  # 6 of 10 positions through the head
    full = run(states, labels)
    torch.testing.assert_close(picked, full * mask, rtol=1e-6, atol=1e-7)
    (picked.sum() * 0.5).backward()
    grads = head.weight.grad.clone(), states.grad.clone()
    head.weight.grad, states.grad = None, None
    ((full * mask).sum() * 0.5).backward()
    torch.testing.assert_close(grads[0], head.weight.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[1], states.grad, rtol=1e-6, atol=1e-7)


def test_no_loss_position_still_runs_one_row_so_the_head_reports_a_zero_gradient() -> None:
    head, states, labels, mask, run, calls = _setup([[False, False, False]])
    picked = loss_positions(states, labels, mask, run)
    assert calls == [1] and torch.equal(picked, torch.zeros(1, 3))
    picked.sum().backward()
    assert head.weight.grad is not None and not head.weight.grad.any()
