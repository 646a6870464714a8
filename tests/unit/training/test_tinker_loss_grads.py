"""The gradient of every Tinker loss with respect to each token's logprob equals its derivative written out in NumPy
from Tinker's formulas (the forward values are checked against NumPy through the SDK in
tests/integration/tinker/test_tinker_losses.py; the model's own backward is autograd's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scalarlm.training.tinker_ops import LOSS_INPUTS, elementwise_loss

# Ratios below, inside and above the default clip range [0.8, 1.2], with advantages of both signs.
OFFSETS = np.array([-0.6, -0.25, -0.15, -0.05, 0.0, 0.05, 0.15, 0.25, 0.7, -0.4])
ADVANTAGES = np.array([-1.5, 2.0, -0.5, 0.5, 2.0, -1.5, 0.5, -0.5, 2.0, -1.5])


def numpy_grad(loss_fn: str, logp: np.ndarray, old: np.ndarray, adv: np.ndarray, weights: np.ndarray,
               config: dict[str, float]) -> np.ndarray:  # fmt: skip
    """d(per-token loss)/d(logp), by hand."""
    ratio = np.exp(logp - old)
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if loss_fn == "cross_entropy":
        return -weights
    if loss_fn == "importance_sampling":  # -r A, dr/dlogp = r
        return -ratio * adv
    if loss_fn == "ppo":  # -min(r A, clip(r) A): the clipped branch, when it is the smaller, is constant in logp
        clipped = np.clip(ratio, low, high)
        takes_clipped = clipped * adv < ratio * adv
        return np.where(takes_clipped, 0.0, -ratio * adv)
    if loss_fn == "cispo":  # -sg(clip(r)) logp A
        return -np.clip(ratio, low, high) * adv
    if loss_fn == "dro":  # -(logp A - beta/2 (logp - old)^2)
        return -(adv - config.get("beta", 0.05) * (logp - old))
    raise AssertionError(loss_fn)


@pytest.mark.parametrize("config", [{}, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1, "beta": 0.3}],
                         ids=["defaults", "configured"])  # fmt: skip
@pytest.mark.parametrize("loss_fn", sorted(LOSS_INPUTS))
def test_the_logprob_gradient_of_each_loss_equals_its_derivative(loss_fn: str, config: dict[str, float]) -> None:
    rng = np.random.default_rng(0)
    n = len(OFFSETS)
    logp_values = -rng.uniform(0.1, 4.0, size=n)
    old = logp_values - OFFSETS  # ratio = exp(OFFSETS)
    weights = rng.choice([0.0, 0.5, 1.0], size=n)
    datum = {"loss_fn_inputs": {"logprobs": old.tolist(), "advantages": ADVANTAGES.tolist(),
                                "weights": weights.tolist()}}  # fmt: skip
    logp = torch.tensor(logp_values, dtype=torch.float32, requires_grad=True)
    elementwise_loss(loss_fn, logp, datum, 0, config).sum().backward()
    expected = numpy_grad(loss_fn, logp_values, old, ADVANTAGES, weights, config)
    assert logp.grad is not None
    np.testing.assert_allclose(logp.grad.numpy(), expected, rtol=1e-5, atol=1e-6)
    if loss_fn in ("ppo", "cispo"):  # the clip range matters here: some tokens in, some out
        ratio = np.exp(OFFSETS)
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        assert ((ratio < low) | (ratio > high)).any() and ((ratio >= low) & (ratio <= high)).any()


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_per_token_clip_thresholds_are_read_from_the_datum(loss_fn: str) -> None:
    """`loss_fn_inputs` clip_low_threshold / clip_high_threshold (the SDK's per-token names) set each token's range;
    the loss and its gradient equal NumPy's with those arrays, and differ from the single range of loss_fn_config."""
    rng = np.random.default_rng(1)
    n = len(OFFSETS)
    logp_values = -rng.uniform(0.1, 4.0, size=n)
    old = logp_values - OFFSETS
    low, high = np.where(np.arange(n) % 2, 0.95, 0.6), np.where(np.arange(n) % 3, 1.05, 1.5)
    datum = {"loss_fn_inputs": {"logprobs": old.tolist(), "advantages": ADVANTAGES.tolist(),
                                "clip_low_threshold": low.tolist(), "clip_high_threshold": high.tolist()}}  # fmt: skip
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # overridden by the per-token arrays
    logp = torch.tensor(logp_values, dtype=torch.float32, requires_grad=True)
    loss = elementwise_loss(loss_fn, logp, datum, 0, config)
    loss.sum().backward()
    ratio = np.exp(OFFSETS)
    clipped = np.clip(ratio, low, high)
    expected = (-np.minimum(ratio * ADVANTAGES, clipped * ADVANTAGES) if loss_fn == "ppo"
                else -clipped * logp_values * ADVANTAGES)  # fmt: skip
    np.testing.assert_allclose(loss.detach().numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logp.grad.numpy(), numpy_grad(loss_fn, logp_values, old, ADVANTAGES, np.ones(n),
                                                             {"clip_low_threshold": low, "clip_high_threshold": high}),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    single = elementwise_loss(loss_fn, torch.tensor(logp_values, dtype=torch.float32),
                              {"loss_fn_inputs": {"logprobs": old.tolist(), "advantages": ADVANTAGES.tolist()}}, 0, config)
    assert not np.allclose(single.numpy(), expected)  # the arrays changed which tokens are clipped
