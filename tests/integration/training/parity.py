"""How close two fp32 runs must be to count as equal, and the measurements behind each bound.

The parity tests compare runs that do the same arithmetic in another order (megatron vs transformers, TP/DP/EP vs one
rank, recompute vs not). How large that rounding comes out depends on the CPU's kernels: the same commit measured
twice the difference on one machine of this box's kind that it did on another (gemma2 logits at TP=2: 6.0e-6 and
1.2e-5). Each bound sits several times above the worse machine and far below what a real bug does.

Imported by the test modules next to it (pytest puts this folder on sys.path; the name is unique in the suite).
"""

from __future__ import annotations

from collections.abc import Sequence

# Forward passes: |ours - reference| over the largest reference value (at least 1). Measured <= 1.75e-6 (mixtral,
# 600 tokens, TP=2) on one machine, 2.7e-6 (gemma2, packed, TP=2) on another. A wrong conversion is >= 1e-2
# (megatron's own llama3 RoPE scaling at 600 tokens: > 0.1).
FORWARD_RELATIVE = 1e-5

# Training curves, step 1: the same weights and tokens, only the order of sums differs. Measured <= 6e-7.
# A wrong reduction shows here: q/k norm grads not summed over TP moved step 1's grad norm by 3e-4 (relative).
FIRST_STEP = 1e-5
# Later steps: Adam's first update is nearly the sign of each grad, so the rounding of near-zero grads becomes moves
# of size lr in those elements, and the curves part by more. Measured <= 6.8e-6 on one machine, 1.75e-5 (loss) on
# another, same commit. Real bugs seen: the loss 5e-3 off by step 4 (the q/k norm grads above), the grad norm 2.77
# vs 1.97 at step 2 (LoRA's TP sum before the DP sync).
LATER_STEPS = 1e-4


def forward_tolerance(scale: float) -> float:
    """The bound for a forward pass whose reference values reach `scale` in magnitude."""
    return FORWARD_RELATIVE * max(1.0, scale)


def step_tolerance(step: int) -> float:
    """The bound for step `step` (1-based) of two layouts of one training run."""
    return FIRST_STEP if step == 1 else LATER_STEPS


def assert_same_curve(ours: Sequence[dict], ref: Sequence[dict], keys: Sequence[str],
                      tolerance: float | None = None) -> None:  # fmt: skip
    """`ours` follows `ref` step by step on `keys` (metrics rows of steps 1, 2, ..., as many in each).

    The first key (a loss) is compared absolutely, every other key relative to max(1, |ref|).
    `tolerance` replaces the per-step bound (runs of the same layout, which repeat each other's arithmetic)."""
    steps = list(range(1, len(ref) + 1))
    assert steps and [r["step"] for r in ours] == [r["step"] for r in ref] == steps, (ours, ref)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True), 1):
        bound = step_tolerance(step) if tolerance is None else tolerance
        for i, key in enumerate(keys):
            scale = 1.0 if i == 0 else max(1.0, abs(float(b[key])))
            assert abs(float(a[key]) - float(b[key])) <= bound * scale, (step, key, ours, ref)
