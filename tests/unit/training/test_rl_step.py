"""`rl_step.rl_batch`: which rows a GRPO step computes, and how, for the losses that read every token or not."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from scalarlm.protocol.training import TrainArgs
from scalarlm.training.rl_step import rl_batch

MAX_LEN = 64


def _rows() -> list[dict]:
    """Two groups of three: one scored alike (advantage 0), one spread; each group's prompt several tokens long."""
    rows = []
    groups = (("What is two plus two? ", (1.0, 1.0, 1.0)), ("What is three plus three? ", (0.0, 1.0, 0.25)))
    for prompt, rewards in groups:
        rows += [{"prompt": prompt, "completion": c, "reward": r} for c, r in zip((" 4", " four", " it is 4"), rewards)]
    return rows


def _trainer(tiny_model_dir: Path, kl_coef: float, aux_loss_coef: float, longrope: tuple | None = None
             ) -> SimpleNamespace:  # fmt: skip
    from transformers import AutoTokenizer

    args = TrainArgs(loss="grpo", kl_coef=kl_coef, moe_aux_loss_coef=aux_loss_coef, batch_size=1)
    par = SimpleNamespace(dp_size=1, dp_rank=0, ep_size=1)
    return SimpleNamespace(args=args, par=par, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), max_len=MAX_LEN,
                           pad_id=0, routing=None, arch=SimpleNamespace(longrope=longrope))  # fmt: skip


def _computed(batch) -> int:
    return sum(int(m.batch.loss_mask.shape[1]) for m in batch.micro if not m.batch.filler)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_without_a_trained_balance_loss_rows_of_advantage_0_are_left_out_and_prompts_computed_once(
        tiny_model_dir: Path, kl_coef: float) -> None:  # fmt: skip
    """The default (`moe_aux_loss_coef` 0, on a dense or a MoE model): without KL the alike-scored group is not
    computed; either way each group's prompt is computed once."""
    every = rl_batch(_trainer(tiny_model_dir, kl_coef, aux_loss_coef=0.5), _rows())
    batch = rl_batch(_trainer(tiny_model_dir, kl_coef, aux_loss_coef=0.0), _rows())
    skipped = 3 if kl_coef == 0 else 0
    assert batch.stats["rows_skipped"] == skipped and batch.stats["prompt_tokens_shared"] > 0, batch.stats
    assert batch.tokens == every.tokens  # every row's tokens are still counted
    shared = batch.stats["prompt_tokens_shared"]
    if kl_coef == 0:
        assert _computed(batch) + shared + batch.skipped_loss_tokens < _computed(every)
    else:
        assert _computed(batch) == _computed(every) - shared


def test_a_trained_balance_loss_computes_every_row_and_every_prompt(tiny_model_dir: Path) -> None:
    """`moe_aux_loss_coef` > 0: the load-balancing loss depends on every token a forward holds, so no row is left out
    and no prompt shared: the step computes every row's tokens."""
    batch = rl_batch(_trainer(tiny_model_dir, 0.0, aux_loss_coef=0.5), _rows())
    assert batch.stats["rows_skipped"] == 0 and batch.stats["prompt_tokens_shared"] == 0, batch.stats
    assert batch.skipped_loss_tokens == 0
    assert _computed(batch) == batch.tokens


@pytest.mark.parametrize(("original", "shares"), [(MAX_LEN, True), (MAX_LEN - 1, False)])
def test_a_longrope_model_shares_prompts_only_when_no_row_can_pass_its_original_context(
        tiny_model_dir: Path, original: int, shares: bool) -> None:  # fmt: skip
    """A shared prompt rotates once: with a row that may be longer than the original context (long factors) beside
    one that is not (short factors) it could not be right for both, so the step then computes each row's prompt."""
    trainer = _trainer(tiny_model_dir, 0.1, aux_loss_coef=0.0, longrope=((), (), original, 1.0))
    assert (rl_batch(trainer, _rows()).stats["prompt_tokens_shared"] > 0) is shares
