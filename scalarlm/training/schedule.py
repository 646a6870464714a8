"""Learning-rate schedule: linear warmup, then cosine, linear or constant decay to `min_lr_ratio * lr`."""

from __future__ import annotations

import math

from scalarlm.protocol.training import TrainArgs


def lr_at(step: int, args: TrainArgs) -> float:
    """The learning rate of 0-based optimizer step `step` of `args.max_steps`."""
    peak = args.learning_rate
    if step < args.warmup_steps:
        return peak * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return peak
    floor = peak * args.min_lr_ratio
    span = max(args.max_steps - args.warmup_steps, 1)
    progress = min((step - args.warmup_steps) / span, 1.0)
    if args.lr_schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
