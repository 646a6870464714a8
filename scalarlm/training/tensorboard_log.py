"""TensorBoard event files for every job, beside `metrics.jsonl`: `tensorboard --logdir $SCALARLM_HOME/jobs`.

Every numeric field of a step's metrics becomes a scalar under the job's `tensorboard/` folder (loss, lr,
grad norm, tokens/s, reward mean/std, KL, clip fraction, staleness: whatever the loss reports), tagged
`train/<field>` and indexed by the step. Rank 0 writes; a resumed job appends a new event file.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SKIP = frozenset({"step", "time"})  # the index and the wall clock are not curves


class TensorBoardLog:
    """One job's event-file writer (flushed every step, so a live TensorBoard sees each point)."""

    def __init__(self, job_root: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = job_root / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def write(self, metrics: dict[str, Any]) -> None:
        """Add every finite numeric metric of one step."""
        step = int(metrics["step"])
        for name, value in metrics.items():
            if name in SKIP or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(f"train/{name}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
