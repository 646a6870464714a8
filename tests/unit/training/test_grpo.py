"""GRPO / Dr. GRPO: advantages and the clipped objective against a direct NumPy computation; zero-advantage groups
give exactly zero gradient; tokenized rows line up their advantages, sampling logprobs and normalising weights, in
padding-free micro-batches that split the documents between them in order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.grpo import (
    ADV_EPS,
    Objective,
    advantages,
    encode_rl_rows,
    grpo_objective,
    parse_rl_rows,
    prompt_units,
    rank_documents,
    rl_micro_batches,
    shared_prompt_tokens,
    token_weights,
    with_gradient,
)

GSPO = Objective(sequence_level=True)
REWARDS = [1.0, 0.0, 0.5, 2.0, 2.0, 2.0, -1.0]
GROUPS = ["a", "a", "a", "b", "b", "b", "c"]


def _direct_advantages(scaling: str) -> np.ndarray:
    """TRL's: centred on the group mean; divided by the group's unbiased std, the whole batch's, or nothing."""
    r = np.array(REWARDS)
    out = np.zeros_like(r)
    for g in set(GROUPS):
        idx = [i for i, x in enumerate(GROUPS) if x == g]
        centred = r[idx] - r[idx].mean()
        std = {"group": r[idx].std(ddof=1) if len(idx) > 1 else 0.0, "batch": r.std(ddof=1), "none": None}[scaling]
        out[idx] = centred / (std + ADV_EPS) if std is not None else centred
    return out


@pytest.mark.parametrize("scaling", ["group", "batch", "none"])
def test_advantages_match_numpy(scaling: str) -> None:
    np.testing.assert_allclose(advantages(REWARDS, GROUPS, scaling), _direct_advantages(scaling), rtol=1e-12,
                               atol=1e-12)  # fmt: skip
    assert not np.allclose(_direct_advantages(scaling), _direct_advantages("group" if scaling != "group" else "none"))


@pytest.mark.parametrize(("loss", "scale_rewards", "scaling"), [
    ("grpo", None, "group"), ("dapo", None, "group"), ("dr_grpo", None, "none"), ("dr_grpo", "batch", "batch"),
    ("grpo", "none", "none"), ("dapo", "batch", "batch"),
])  # fmt: skip
def test_each_loss_scales_its_advantages_as_trl_unless_told(loss: str, scale_rewards: str | None, scaling: str) -> None:
    from scalarlm.protocol.training import TrainArgs

    assert TrainArgs(loss=loss, scale_rewards=scale_rewards).reward_scaling == scaling
    with pytest.raises(ValueError, match="scale_rewards is a GRPO setting"):
        TrainArgs(loss="sft", scale_rewards="group")


def test_equal_rewards_and_singletons_have_zero_advantage() -> None:
    adv = advantages(REWARDS, GROUPS, "group")
    assert adv[3:] == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("scaling", ["group", "batch", "none"])
def test_a_group_of_equal_rewards_has_advantage_exactly_zero_even_where_their_float_mean_is_not_them(scaling: str
                                                                                                     ) -> None:
    rewards = [0.1, 0.1, 0.1, 0.7, 0.7, 0.7]
    assert sum(rewards[:3]) / 3 != 0.1  # the float mean misses the value by an ulp, so r - mean would not be 0
    assert advantages(rewards, ["a"] * 3 + ["b"] * 3, scaling) == [0.0] * 6


def _fixed_batch():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 6, generator=gen) * 2
    old = logp + (torch.rand(3, 6, generator=gen) - 0.5) * 0.8  # ratios both sides of the clip range
    ref = logp + (torch.rand(3, 6, generator=gen) - 0.5) * 0.3
    adv = torch.tensor([1.5, -0.7, 0.9])[:, None].expand(3, 6).clone()
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    has_old = torch.ones(3, 6)
    has_old[2] = 0  # a row without sampling logprobs: ratio 1
    return logp, old, ref, adv, mask, has_old


@pytest.mark.parametrize(("loss", "eps_high"), [("grpo", None), ("dr_grpo", None), ("dapo", None), ("dapo", 0.28)])
def test_clipped_objective_matches_numpy(loss: str, eps_high: float | None) -> None:
    logp, old, ref, adv, mask, has_old = _fixed_batch()
    lengths = mask.sum(1)
    if loss == "grpo":
        w = (1.0 / (lengths * 3))[:, None].expand(3, 6)
    elif loss == "dapo":
        w = torch.full((3, 6), 1.0 / lengths.sum().item())
    else:
        w = torch.full((3, 6), 1.0 / (lengths.max().item() * 3))
    eps, beta = 0.2, 0.05
    got, stats = grpo_objective(logp, old, has_old, adv, w, mask, Objective(eps, eps_high, beta), ref)
    high = eps if eps_high is None else eps_high  # DAPO's clip-higher: the upper bound apart

    lp, o, rf, a, m = (x.double().numpy() for x in (logp, old, ref, adv, mask))
    o = np.where(has_old.numpy() > 0, o, lp)
    ratio = np.exp(lp - o)
    pg = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + high) * a)
    kl = np.exp(rf - lp) - (rf - lp) - 1
    per_token = (pg + beta * kl) * m
    if loss == "grpo":  # mean over each sequence's tokens, then over sequences
        want = np.mean(per_token.sum(1) / m.sum(1))
    elif loss == "dapo":  # every token of the batch alike (TRL's default loss_type)
        want = per_token.sum() / m.sum()
    else:  # constant normaliser: max completion length x sequences
        want = per_token.sum() / (m.sum(1).max() * 3)
    assert got.item() == pytest.approx(want, rel=1e-5)
    clipped = ((ratio * a > np.clip(ratio, 1 - eps, 1 + high) * a) * m).sum()
    assert stats["clipped_tokens"].item() == clipped > 0
    assert stats["kl_sum"].item() == pytest.approx((kl * m).sum(), rel=1e-5)


def _segments(mask: torch.Tensor) -> torch.Tensor:
    """Row i's completion tokens are segment i + 1 (as `rl_micro_batches` numbers a step's documents)."""
    return (torch.arange(1, mask.shape[0] + 1, dtype=torch.float32)[:, None] * mask)


@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_sequence_level_ratio_matches_numpy(eps_high: float | None) -> None:
    """GSPO (TRL's importance_sampling_level "sequence"): every token of a completion takes the exp of the mean of its
    tokens' log ratios, clipped as the token ratio is; the row without sampling logprobs has ratio 1."""
    logp, old, ref, adv, mask, has_old = _fixed_batch()
    adv = adv * torch.tensor([-1.0, -1.0, 1.0])[:, None]  # so the first two rows' ratios (0.99, 1.07) are clipped
    w = (1.0 / (mask.sum(1) * 3))[:, None].expand(3, 6)
    eps, beta = 0.005, 0.05  # sequence ratios stay near 1: GSPO clips them tightly
    got, stats = grpo_objective(logp, old, has_old, adv, w, mask, Objective(eps, eps_high, beta, sequence_level=True),
                                ref, segments=_segments(mask))  # fmt: skip
    high = eps if eps_high is None else eps_high

    lp, o, rf, a, m = (x.double().numpy() for x in (logp, old, ref, adv, mask))
    o = np.where(has_old.numpy() > 0, o, lp)
    seq = ((lp - o) * m).sum(1) / m.sum(1)
    ratio = np.exp(seq)[:, None] * np.ones_like(lp)
    assert abs(seq[0]) > 0.005 and seq[2] == 0.0
    pg = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + high) * a)
    kl = np.exp(rf - lp) - (rf - lp) - 1
    want = np.mean(((pg + beta * kl) * m).sum(1) / m.sum(1))
    assert got.item() == pytest.approx(want, rel=1e-5)
    token_level, _ = grpo_objective(logp, old, has_old, adv, w, mask, Objective(eps, eps_high, beta), ref)
    assert abs(token_level.item() - got.item()) > 1e-4  # the two levels differ on this batch
    assert stats["clipped_tokens"].item() == ((ratio * a > np.clip(ratio, 1 - eps, 1 + high) * a) * m).sum() > 0


@pytest.mark.parametrize(("objective", "sampled"), [
    (GSPO, False),  # GSPO's sequence ratio
    (Objective(0.2, correction="sequence_truncate", correction_bounds=(0.5, 1.1), sequence_level=True), True),
])  # fmt: skip
def test_sequence_level_packed_gives_the_padded_loss_and_gradients(objective: Objective, sampled: bool) -> None:
    """The completions of a padding-free row (one [1, T] row, segments apart) get the loss and the gradient of the
    padded [rows, T] layout, where each row is its own sequence: each sums its log ratios (GSPO's ratio, or a
    sequence-level sampler correction against the `sampled` logprobs) over its own segment."""
    logp, old, ref, adv, mask, has_old = _fixed_batch()
    w = (1.0 / (mask.sum(1) * 3))[:, None].expand(3, 6)
    first = logp + 0.2 * torch.linspace(-1, 1, 6) if sampled else None
    padded_logp = logp.clone().requires_grad_(True)
    padded, _ = grpo_objective(padded_logp, old, has_old, adv, w, mask, objective, None, first, _segments(mask))
    padded.backward()
    packed_logp = logp.reshape(1, 18).clone().requires_grad_(True)
    packed, _ = grpo_objective(packed_logp, *(t.reshape(1, 18) for t in (old, has_old, adv, w, mask)), objective,
                               None, None if first is None else first.reshape(1, 18),
                               _segments(mask).reshape(1, 18))  # fmt: skip
    packed.backward()
    assert packed.item() == pytest.approx(padded.item(), rel=1e-6)
    torch.testing.assert_close(packed_logp.grad.reshape(3, 6), padded_logp.grad, rtol=1e-6, atol=1e-9)
    assert (padded_logp.grad[mask > 0] != 0).all()  # every completion token gets the sequence ratio's gradient


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize("loss", ["cispo", "sapo"])
def test_cispo_and_sapo_objectives_and_gradients_match_numpy(loss: str) -> None:
    """TRL's cispo (the ratio capped at eps_high and detached, times A and the logprob) and sapo (the gate
    sigmoid(t (ratio - 1)) 4 / t times A, t by A's sign): the loss and its gradient per logprob, written out."""
    logp, old, ref, adv, mask, has_old = _fixed_batch()
    old = old - 0.5 * torch.tensor([1.0, 0.0, 0.0])[:, None]  # row 0's ratios pass cispo's cap of 1.3
    w = torch.full((3, 6), 0.1)
    objective = Objective(clip_eps_high=1.3, surrogate="cispo") if loss == "cispo" else Objective(surrogate="sapo")
    x = logp.clone().requires_grad_(True)
    got, stats = grpo_objective(x, old, has_old, adv, w, mask, objective)
    got.backward()

    lp, o, a, m = (t.double().numpy() for t in (logp, old, adv, mask))
    r = np.exp(lp - np.where(has_old.numpy() > 0, o, lp))
    if loss == "cispo":
        weight = np.minimum(r, 1.3)
        per_token, grad = -weight * a * lp, -weight * a  # the weight carries no gradient
        clipped = ((r > 1.3) & (a > 0)) * m
    else:
        t = np.where(a > 0, 1.0, 1.05)
        gate = _sigmoid(t * (r - 1))
        per_token, grad = -gate * 4 / t * a, -4 * gate * (1 - gate) * r * a  # d/dlogp through the ratio
        clipped = np.zeros_like(m)
    assert got.item() == pytest.approx((per_token * m * 0.1).sum(), rel=1e-5)
    np.testing.assert_allclose(x.grad.double().numpy(), grad * m * 0.1, rtol=1e-5, atol=1e-9)
    assert stats["clipped_tokens"].item() == clipped.sum()
    assert loss == "sapo" or clipped.sum() > 0


def test_delta_caps_the_unclipped_ratio_and_the_bias_corrected_kl_is_weighted_by_the_ratio() -> None:
    """TRL's delta (INTELLECT-2's two-sided clipping: ``-min(min(ratio, delta) A, clip(ratio) A)``) and
    use_bias_correction_kl (the KL term times the differentiable ratio): loss and gradient against NumPy."""
    logp, old, ref, adv, mask, has_old = _fixed_batch()
    adv = -adv.abs()  # negative advantages: the unclipped term is the one that grows with the ratio
    old = old - 0.5 * torch.tensor([1.0, 0.0, 0.0])[:, None]  # row 0's ratios pass delta = 1.4
    w = torch.full((3, 6), 0.1)
    x = logp.clone().requires_grad_(True)
    got, stats = grpo_objective(x, old, has_old, adv, w, mask, Objective(0.2, kl_coef=0.05, delta=1.4,
                                                                         kl_bias_correction=True), ref)  # fmt: skip
    got.backward()
    lp, o, rf, a, m = (t.double().numpy() for t in (logp, old, ref, adv, mask))
    r = np.exp(lp - np.where(has_old.numpy() > 0, o, lp))
    capped, clipped = np.minimum(r, 1.4), np.clip(r, 0.8, 1.2)
    kl = np.exp(rf - lp) - (rf - lp) - 1
    want = ((-np.minimum(capped * a, clipped * a) + 0.05 * kl * r) * m * 0.1).sum()
    assert got.item() == pytest.approx(want, rel=1e-5)
    assert ((r > 1.4) * m).sum() > 0  # delta binds somewhere
    first = capped * a <= clipped * a
    grad_pg = np.where(first & (r < 1.4), -r * a, 0.0)  # the capped and the clipped branches have no gradient
    grad_kl = 0.05 * (kl * r + (1 - np.exp(rf - lp)) * r)  # d/dlogp (kl x ratio)
    np.testing.assert_allclose(x.grad.double().numpy(), (grad_pg + grad_kl) * m * 0.1, rtol=1e-5, atol=1e-8)
    plain, _ = grpo_objective(logp, old, has_old, adv, w, mask, Objective(0.2, kl_coef=0.05), ref)
    assert abs(plain.item() - want) > 1e-4


def test_off_policy_sequence_mask_leaves_out_drifted_completions_with_a_negative_advantage() -> None:
    """TRL's off_policy_mask_threshold (DeepSeek-V3.2): a completion with A < 0 whose mean (sampling - policy)
    logprob passes the threshold adds nothing to the policy term; one with A >= 0, or close to the policy, or
    without sampling logprobs, stays. NumPy."""
    logp, old, ref, adv, mask, has_old = _fixed_batch()
    old = logp + 0.02 * torch.linspace(-1, 1, 6)
    old[1] = logp[1] + 0.3  # row 1 (A < 0) drifted: mean KL 0.3
    w = torch.full((3, 6), 0.1)
    got, stats = grpo_objective(logp, old, has_old, adv, w, mask, Objective(0.2, off_policy_threshold=0.1),
                                segments=_segments(mask))  # fmt: skip
    lp, o, a, m, has = (t.double().numpy() for t in (logp, old, adv, mask, has_old))
    kl = np.where(has > 0, o - lp, 0.0)
    mean_kl = (kl * m).sum(1, keepdims=True) / m.sum(1, keepdims=True)
    keep = ((a >= 0) | (mean_kl <= 0.1)).astype(float)
    assert keep[:, 0].tolist() == [1.0, 0.0, 1.0]
    r = np.exp(lp - np.where(has > 0, o, lp))
    want = (-np.minimum(r * a, np.clip(r, 0.8, 1.2) * a) * keep * m * 0.1).sum()
    assert got.item() == pytest.approx(want, rel=1e-5)
    assert stats["off_policy_masked"].item() == m[1].sum()


def _sampler_weights_numpy(trainer: np.ndarray, sampler: np.ndarray, has: np.ndarray, m: np.ndarray, mode: str,
                           low: float | None, high: float | None) -> np.ndarray:  # fmt: skip
    """TRL's vllm_importance_sampling_ratio: exp(trainer - sampler) per token, or of its sum per completion; clipped
    (truncate) or 0 outside [low, high] (mask); a token without a sampling logprob adds 0."""
    diff = np.where(has > 0, trainer - sampler, 0.0) * m
    if mode.startswith("sequence"):
        diff = diff.sum(1, keepdims=True) * np.ones_like(diff)
    r = np.exp(diff)
    lo, hi = -np.inf if low is None else low, np.inf if high is None else high
    return np.clip(r, lo, hi) if mode.endswith("truncate") else np.where((r < lo) | (r > hi), 0.0, r)


@pytest.mark.parametrize(("mode", "low", "high"), [("token_truncate", None, 1.2), ("token_mask", 0.8, 1.2),
                                                   ("sequence_truncate", 0.5, 1.1), ("sequence_mask", None, 1.1)])
def test_sampler_correction_weighs_each_token_as_trls_vllm_importance_sampling(mode: str, low: float | None,
                                                                                high: float | None) -> None:
    """TRL's vllm_importance_sampling_correction: the ratio compares with the trainer's own logprobs (ratio 1 in a
    batch's first step, the first step's logprobs in its later ones) and the clipped objective is multiplied by the
    truncated or masked exp(trainer - sampler logprob); the KL term is not. NumPy, loss and gradient."""
    logp, old, ref, adv, mask, has_old = _fixed_batch()
    w = torch.full((3, 6), 0.1)
    objective = Objective(0.2, kl_coef=0.05, correction=mode, correction_bounds=(low, high))
    lp, o, rf, a, m, has = (t.double().numpy() for t in (logp, old, ref, adv, mask, has_old))
    kl = np.exp(rf - lp) - (rf - lp) - 1
    first = logp + 0.3 * torch.linspace(-1, 1, 6)  # a later step: the policy moved since the first
    for trainer_logp in (None, first):
        x = logp.clone().requires_grad_(True)
        got, stats = grpo_objective(x, old, has_old, adv, w, mask, objective, ref, trainer_logp, _segments(mask))
        got.backward()
        t = lp if trainer_logp is None else trainer_logp.double().numpy()
        weight = _sampler_weights_numpy(t, o, has, m, mode, low, high)
        r = np.exp(lp - t)
        clipped = np.clip(r, 0.8, 1.2)
        pg = -np.minimum(r * a, clipped * a)
        want = ((pg * weight + 0.05 * kl) * m * 0.1).sum()
        assert got.item() == pytest.approx(want, rel=1e-5)
        grad_pg = np.where(r * a <= clipped * a, -r * a, 0.0)  # the clipped branch has no gradient
        grad = (grad_pg * weight + 0.05 * (1 - np.exp(rf - lp))) * m * 0.1
        np.testing.assert_allclose(x.grad.double().numpy(), grad, rtol=1e-5, atol=1e-8)
        assert stats["correction_sum"].item() == pytest.approx((weight * m).sum(), rel=1e-5)
        assert stats["correction_masked"].item() == ((weight == 0) * m).sum()
    if mode.endswith("mask"):
        assert 0 < stats["correction_masked"].item() < m.sum()  # this batch masks some tokens, not all
    else:
        assert stats["correction_masked"].item() == 0 and ((weight == high) * m).sum() > 0  # and truncates some
    off, _ = grpo_objective(logp, old, has_old, adv, w, mask, Objective(0.2, kl_coef=0.05), ref)
    assert abs(off.item() - want) > 1e-4  # without the correction the ratio compares with the sampler


def test_policy_settings_a_loss_does_not_read_are_refused_and_a_stored_config_reads_back() -> None:
    from scalarlm.protocol.training import TrainArgs

    unbounded = {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None}
    for kwargs, text in [({"loss": "cispo"}, "caps its importance weight at clip_eps_high"),
                         ({"loss": "sapo", "delta": 1.5}, "delta caps the clipped ratio"),
                         ({"loss": "sft", "off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold is a GRPO"),
                         ({"loss": "grpo", "use_bias_correction_kl": True}, "kl_coef is 0"),
                         ({"loss": "sapo", "clip_eps": 0.3}, "clip_eps is not read"),
                         ({"loss": "sapo", "clip_eps_high": 0.3}, "clip_eps_high is not read"),
                         ({"loss": "dapo", "sapo_temperature_neg": 2.0}, "read by loss 'sapo' only"),
                         ({"loss": "grpo", "vllm_importance_sampling_mode": "token_mask"}, "send it too"),
                         ({"loss": "sft", "vllm_importance_sampling_correction": True}, "is a GRPO setting"),
                         ({"loss": "grpo", "vllm_importance_sampling_correction": True,
                           "vllm_importance_sampling_clip_min": 3.0}, "must be less than"),
                         ({"loss": "grpo", "vllm_importance_sampling_correction": True, **unbounded},
                          "send vllm_importance_sampling_clip_max")]:  # fmt: skip
        with pytest.raises(ValueError, match=text):
            TrainArgs(**kwargs)
    for kwargs in ({"loss": "cispo", "clip_eps_high": 5.0}, {"loss": "sapo", "sapo_temperature_pos": 2.0},
                   {"loss": "dapo", "vllm_importance_sampling_correction": True,
                    "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5}):
        args = TrainArgs(**kwargs)
        assert TrainArgs.model_validate(args.model_dump(mode="json")) == args  # job.yaml writes every field out
    objective = Objective.of(TrainArgs(loss="dapo", vllm_importance_sampling_correction=True))
    assert (objective.surrogate, objective.correction, objective.correction_bounds) == ("clip", "sequence_mask",
                                                                                         (None, 3.0))


def test_token_weights_are_each_losss_normaliser(tiny_model_dir: Path) -> None:
    """Each completion token's weight, from the trainer's own documents, against TRL's normalisers written out:
    grpo 1 / (len_i x N); dr_grpo 1 / (max_completion_length x N), or the batch's longest completion when unset;
    dapo and cispo 1 / (every completion token of the batch); sapo as grpo."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [" 4", " four, I think", " 5"]
    raw = [{"prompt": "2+2=", "completion": c, "reward": float(i)} for i, c in enumerate(texts)]
    rows = parse_rl_rows(raw)
    lengths = np.array([len(tok(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in raw])  # + EOS
    for loss, mcl, want in [("grpo", None, 1 / (lengths * 3)), ("dr_grpo", None, [1 / (lengths.max() * 3)] * 3),
                            ("dr_grpo", 64, [1 / (64 * 3)] * 3), ("dapo", None, [1 / lengths.sum()] * 3),
                            ("cispo", None, [1 / lengths.sum()] * 3), ("sapo", None, 1 / (lengths * 3))]:
        docs, _ = encode_rl_rows(tok, rows, "group", max_len=64)
        assert [sum(d.doc.targets[1:]) for d in docs] == lengths.tolist()
        np.testing.assert_allclose(token_weights(docs, loss, mcl), want, rtol=1e-12)


def test_masked_truncated_completions_weigh_nothing_as_trl_zeroes_their_completion_mask(tiny_model_dir: Path) -> None:
    """TRL's mask_truncated_completions zeroes the completion mask of a completion that did not finish: it adds 0 to
    every loss, leaves dapo's token count, and stays in the sequence counts of grpo and dr_grpo (TRL's `.mean()` over
    sequences, its `L x N`); its reward still counts in its group's advantages."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [" 4", " four, I think", " 5"]
    raw = [{"prompt": "2+2=", "completion": c, "reward": r, "finish_reason": f}
           for c, r, f in zip(texts, (0.0, 2.0, 1.5), ("stop", "length", "stop"))]  # fmt: skip
    rows = parse_rl_rows(raw)
    lengths = np.array([len(tok(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in raw])
    docs, stats = encode_rl_rows(tok, rows, "group", max_len=64)
    assert stats["rows_at_max_tokens"] == 1 and [d.at_max_tokens for d in docs] == [False, True, False]
    assert docs[0].advantage < 0 < docs[2].advantage < docs[1].advantage  # its reward counts in the group's
    keep = np.array([1.0, 0.0, 1.0])
    for loss, mcl, want in [("grpo", None, keep / (lengths * 3)), ("dr_grpo", 64, keep / (64 * 3)),
                            ("dapo", None, keep / (lengths * keep).sum())]:
        np.testing.assert_allclose(token_weights(docs, loss, mcl, mask_at_max_tokens=True), want, rtol=1e-12)
        assert token_weights(docs, loss, mcl)[1] > 0  # unmasked unless asked
    kept, weights, left, left_tokens = with_gradient(docs, token_weights(docs, "dapo", None, True))
    assert [d.doc for d in kept] == [docs[0].doc, docs[2].doc] and (left, left_tokens) == (1, lengths[1])


def test_a_later_step_of_a_batch_compares_rows_without_sampling_logprobs_with_the_first_step() -> None:
    """num_iterations > 1: a token without a sampling logprob takes the batch's first-step logprob as its old one
    (NumPy), while tokens with one keep it; without `first_logp` such a token's ratio is 1."""
    logp, old, _, adv, mask, has_old = _fixed_batch()
    first = logp.detach() + 0.4 * torch.linspace(-1, 1, 6)  # the policy moved since the first step
    w = torch.full((3, 6), 0.1)
    got, stats = grpo_objective(logp, old, has_old, adv, w, mask, first_logp=first)
    lp, o, f, a, m = (x.double().numpy() for x in (logp, old, first, adv, mask))
    ratio = np.exp(lp - np.where(has_old.numpy() > 0, o, f))
    pg = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
    assert got.item() == pytest.approx((pg * m * 0.1).sum(), rel=1e-5)
    clipped_row = ((ratio * a > np.clip(ratio, 0.8, 1.2) * a) * m)[2].sum()
    assert clipped_row > 0  # the row without logprobs is now off-policy and clipped where it moved far
    on_policy, _ = grpo_objective(logp, old, has_old, adv, w, mask)
    assert on_policy.item() != pytest.approx(got.item(), rel=1e-6)


def test_equal_reward_group_contributes_no_gradient() -> None:
    """Policy-gradient terms of a group whose rewards are all equal have zero gradient, even off-policy."""
    torch.manual_seed(0)
    vocab, dim = 11, 5
    emb = torch.nn.Embedding(vocab, dim)
    head = torch.nn.Linear(dim, vocab)
    tokens = torch.randint(0, vocab, (6, 7))
    adv = torch.tensor(advantages(REWARDS[:6], GROUPS[:6], "group"), dtype=torch.float32)[:, None].expand(6, 7)
    logits = head(emb(tokens[:, :-1]))
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    mask = torch.ones_like(logp)
    only_b = torch.zeros_like(logp)
    only_b[3:] = 1.0  # group "b" (rows 3..5), rewards all 2.0
    old = logp.detach() + 0.3  # off-policy: ratio != 1
    loss, _ = grpo_objective(logp, old, torch.ones_like(logp), adv[:, :6], torch.full_like(logp, 0.1), only_b)
    loss.backward(retain_graph=True)
    assert torch.count_nonzero(head.weight.grad) == 0 and torch.count_nonzero(emb.weight.grad) == 0
    head.zero_grad(), emb.zero_grad()
    loss_a, _ = grpo_objective(logp, old, torch.ones_like(logp), adv[:, :6], torch.full_like(logp, 0.1), mask - only_b)
    loss_a.backward()
    assert torch.count_nonzero(head.weight.grad) > 0  # the other group does train


def test_rows_line_up_with_tokens(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    completion = "the answer is 4"
    n = len(tok(completion, add_special_tokens=False)["input_ids"])
    rows = parse_rl_rows(
        [
            {"prompt": "2+2=", "completion": completion, "reward": 1.0, "logprobs": [-0.5] * (n + 1)},
            {"prompt": "2+2=", "completion": completion + " !", "reward": 0.0},
            {"prompt": "3+3=", "completion": "6", "reward": 1.0, "logprobs": [-9.0] * 40},  # re-tokenized: on-policy
        ]
    )
    for loss, scaling in (("grpo", "group"), ("dr_grpo", "none")):
        docs, stats = encode_rl_rows(tok, rows, scaling, max_len=64)
        assert stats["logprobs_mismatched_rows"] == 1 and stats["groups"] == 2
        assert docs[0].doc.tokens[-1] == tok.eos_token_id and sum(docs[0].doc.targets) == n + 1
        weights = token_weights(docs, loss)
        (mb,) = rl_micro_batches(docs, weights, 64, 8, pad_id=0, share=False)  # padding-free: one [1, T] row
        assert mb.batch.tokens.shape == (1, sum(len(d.doc.tokens) for d in docs)) and mb.batch.attention_mask is None
        assert torch.equal(mb.has_old.bool(), (mb.old_logprobs == -0.5))
        assert mb.has_old.sum().item() == n + 1
        assert torch.equal((mb.weights > 0).float(), mb.batch.loss_mask)
        if loss == "grpo":
            assert mb.weights.sum().item() == pytest.approx(1.0)
        start, end = mb.batch.doc_bounds[2:4]
        assert mb.advantages[0, start:end].abs().sum().item() == 0.0  # a singleton group has no advantage


def test_rows_of_one_prompt_pack_as_one_shared_prefix_document(tiny_model_dir: Path) -> None:
    """The rows of a prompt pack as its tokens but the last once, then each row from the prompt's last token on (it
    predicts the completion's first), each part continuing the prefix: its positions go on from the prefix's length.
    Every completion token keeps its label, advantage, sampling logprob and weight; a group too long for `max_len`
    packs as several shared-prefix documents; a lone prompt is an ordinary document."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = [" four", " it is 4", " 5, I think", " 4!"]
    raw = [{"prompt": "What is 2+2?", "completion": t, "reward": float(i), "logprobs": [-0.1 * (i + 1)] * 9}
           for i, t in enumerate(texts)] + [{"prompt": "3+3=", "completion": " 6", "reward": 1.0}]  # fmt: skip
    raw = [dict(r, completion_token_ids=tok(r["completion"], add_special_tokens=False)["input_ids"]) for r in raw]
    for r in raw[:4]:
        r["logprobs"] = r["logprobs"][: len(r["completion_token_ids"])]
    docs, _ = encode_rl_rows(tok, parse_rl_rows(raw), "group", max_len=64)
    weights = token_weights(docs, "grpo")
    cut = len(tok("What is 2+2?")["input_ids"]) - 1
    (plain,) = rl_micro_batches(docs, weights, 64, 8, pad_id=0, share=False)
    (mb,) = rl_micro_batches(docs, weights, 64, 8, pad_id=0)
    expected = [*docs[0].doc.tokens[:cut], *(t for d in docs[:4] for t in d.doc.tokens[cut:]), *docs[4].doc.tokens]
    assert mb.batch.tokens[0].tolist() == expected
    assert mb.batch.doc_continues == (-1, 0, 0, 0, 0, -1)
    bounds, positions = mb.batch.doc_bounds, mb.batch.position_ids[0].tolist()
    assert positions[: cut] == list(range(cut))
    for part, doc in zip(range(1, 5), docs):
        assert positions[bounds[part] : bounds[part + 1]] == list(range(cut, len(doc.doc.tokens)))
    assert positions[bounds[5] :] == list(range(len(docs[4].doc.tokens)))
    for name in ("advantages", "old_logprobs", "has_old", "weights"):  # each completion token's, in order
        assert torch.equal(getattr(mb, name)[mb.batch.loss_mask > 0], getattr(plain, name)[plain.batch.loss_mask > 0])
    assert torch.equal(mb.batch.labels[mb.batch.loss_mask > 0], plain.batch.labels[plain.batch.loss_mask > 0])
    assert mb.batch.tokens.shape[1] == plain.batch.tokens.shape[1] - 3 * cut  # the prompt once, not four times

    parts = [len(d.doc.tokens) - cut for d in docs[:4]]
    tight = cut + max(parts[0] + parts[1], parts[2] + parts[3])  # room for two of the group's rows per document
    assert sum(parts[:3]) > tight - cut
    (split,) = rl_micro_batches(docs, weights, tight, 8, pad_id=0)
    assert split.batch.doc_continues == (-1, 0, 0, -1, 3, 3, -1)


def _computed_tokens(docs: list, rows: list[int]) -> int:
    mine = [docs[i] for i in rows]
    return sum(len(d.tokens) for d in mine) - shared_prompt_tokens(mine, prompt_units(mine, 4096))


def test_dp_ranks_take_whole_prompt_groups_balanced_by_the_tokens_they_compute() -> None:
    """Each DP rank gets whole groups where that keeps the ranks even, so a group shares its prompt once; a group
    bigger than half a rank's share is halved. At DP 8 with 4 groups of 8 rows, dealing rows one to a rank would
    share nothing: every rank still gets rows, and the slowest rank computes fewer tokens than that."""
    from scalarlm.training.data import Document

    def doc(prompt: int, length: int) -> Document:
        tokens = tuple([1] + [100 + prompt] * 29 + [7] * length)  # a 30-token prompt
        return Document(tokens, (False,) * 30 + (True,) * length)

    docs = [doc(g, 4 + 3 * r) for g in range(4) for r in range(8)]  # groups of equal cost
    two = rank_documents(docs, 2, 4096, share=True)
    assert sorted(i for r in two for i in r) == list(range(32))
    assert all(i // 8 * 8 + k in r for r in two for i in r for k in range(8))  # whole groups
    assert _computed_tokens(docs, two[0]) == _computed_tokens(docs, two[1])
    for dp in (4, 8):
        split = rank_documents(docs, dp, 4096, share=True)
        dealt = rank_documents(docs, dp, 4096, share=False)
        assert dealt == [list(range(r, 32, dp)) for r in range(dp)]
        assert sorted(i for r in split for i in r) == list(range(32)) and all(split)
        assert max(_computed_tokens(docs, r) for r in split) < max(_computed_tokens(docs, r) for r in dealt)
    uneven = [doc(0, 200)] * 8 + [doc(g, 5) for g in range(1, 4) for _ in range(8)]  # one group 10x the others
    split = rank_documents(uneven, 2, 4096, share=True)
    loads = [_computed_tokens(uneven, r) for r in split]
    assert max(loads) <= 1.25 * sum(loads) / 2, loads  # the big group was halved to even the ranks out


def test_bad_rows_are_rejected() -> None:
    with pytest.raises(InvalidRequest):
        parse_rl_rows([{"prompt": "x", "completion": "y"}])
    with pytest.raises(InvalidRequest):
        parse_rl_rows([{"completion": "y", "reward": 1}])


def test_sampled_token_ids_are_trained_as_sampled(tiny_model_dir: Path) -> None:
    """Token ids from generate keep every logprob: no re-tokenization, no EOS added when none was sampled."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "the answer is 4"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    odd = list(reversed(ids))  # what a sampler may emit: tokens whose text re-tokenizes differently
    rows = parse_rl_rows([
        {"prompt": "2+2=", "completion": tok.decode(odd), "completion_token_ids": odd, "reward": 1.0,
         "logprobs": [-0.25] * len(odd)},
        {"prompt": "2+2=", "completion": text, "completion_token_ids": ids + [tok.eos_token_id], "reward": 0.0,
         "logprobs": [-0.5] * (len(ids) + 1)},
        {"prompt": "2+2=", "completion": text, "completion_token_ids": ids, "reward": 0.5, "logprobs": [-0.5]},
        {"prompt": "2+2=", "completion": text, "completion_token_ids": [len(tok) + 5], "reward": 0.2},
    ])  # fmt: skip
    docs, stats = encode_rl_rows(tok, rows, "group", max_len=64)

    prompt = len(tok("2+2=")["input_ids"])
    assert list(docs[0].doc.tokens[prompt:]) == odd and docs[0].old_logprobs == (-0.25,) * len(odd)
    assert docs[1].doc.tokens[-1] == tok.eos_token_id and len(docs[1].old_logprobs) == len(ids) + 1
    assert docs[2].old_logprobs is None  # one logprob for several tokens: counted, trains on-policy
    assert list(docs[3].doc.tokens[prompt:]) == ids + [tok.eos_token_id]  # foreign ids: the text is trained
    assert stats["logprobs_mismatched_rows"] == 2


def test_packed_micro_batches_split_documents_in_order_without_padding(tiny_model_dir: Path) -> None:
    """Documents pack into blocks of at most max_len tokens, `blocks_per_micro` blocks per micro-batch; each
    document's advantage rides along at its own completion positions and nothing is padded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = parse_rl_rows([{"prompt": f"{i}+{i}=", "completion": " x" * (1 + i % 5), "reward": float(i % 3),
                           "group": str(i // 3)} for i in range(12)])  # fmt: skip
    docs, _ = encode_rl_rows(tok, rows, "group", max_len=32)
    micro = rl_micro_batches(docs, token_weights(docs, "grpo"), 32, 2, pad_id=0)
    assert len(micro) > 1 and all(m.batch.tokens.shape[1] <= 2 * 32 for m in micro)
    flat = [t for m in micro for t in m.batch.tokens[0].tolist()]
    assert flat == [t for d in docs for t in d.doc.tokens]  # every document once, in order, no padding
    advs = torch.cat([m.advantages[0] for m in micro])
    masks = torch.cat([m.batch.loss_mask[0] for m in micro])
    offset = 0
    for d in docs:
        n = len(d.doc.tokens)
        assert torch.all(advs[offset : offset + n][masks[offset : offset + n] > 0] == d.advantage)
        offset += n


def test_asked_for_a_count_the_micro_batches_are_the_same_after_fillers(tiny_model_dir: Path) -> None:
    """Expert parallelism asks every rank for the same number of micro-batches: the same micro-batches as without
    a count, after fillers (one pad token, zero weight and advantage) up to it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = parse_rl_rows([{"prompt": f"{i}+{i}=", "completion": " x" * (1 + i % 5), "reward": float(i % 3),
                           "group": str(i // 3)} for i in range(12)])  # fmt: skip
    docs, _ = encode_rl_rows(tok, rows, "group", max_len=32)
    weights = token_weights(docs, "grpo")
    natural = rl_micro_batches(docs, weights, 32, 2, pad_id=0)
    padded = rl_micro_batches(docs, weights, 32, 2, pad_id=0, count=len(natural) + 2)
    assert [m.batch.filler for m in padded] == [True, True] + [False] * len(natural)
    for a, b in zip(padded[2:], natural):
        assert torch.equal(a.batch.tokens, b.batch.tokens) and torch.equal(a.weights, b.weights)
    assert all(m.weights.sum() == 0 and m.advantages.sum() == 0 and m.batch.tokens.shape == (1, 1) for m in padded[:2])
    with pytest.raises(ValueError, match="do not fit"):
        rl_micro_batches(docs, weights, 32, 2, pad_id=0, count=len(natural) - 1)
