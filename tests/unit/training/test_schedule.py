"""Learning-rate schedule: warmup then cosine / linear / constant."""

from __future__ import annotations

import pytest

from scalarlm.protocol.training import TrainArgs
from scalarlm.training.schedule import lr_at


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_then_decay(kind: str) -> None:
    args = TrainArgs(max_steps=100, learning_rate=1e-3, warmup_steps=10, lr_schedule=kind, min_lr_ratio=0.1)
    lrs = [lr_at(s, args) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    if kind == "constant":
        assert set(lrs[10:]) == {1e-3}
    else:
        assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
        assert lrs[-1] >= 1e-4 and lrs[-1] < 1.2e-4
    if kind == "cosine":
        assert lrs[55] == pytest.approx(1e-4 + 0.9e-3 * 0.5)
