"""Padding-free GRPO is the padded computation without the padding: on a fixed batch of scored rows of different
lengths, the trainer's packed micro-batches and GRPO loss give the padded layout's loss and gradients (per parameter,
fp32) while computing on about a third of the tokens: no padding, each group's prompt once (shared prefixes), and the
output layer on the completion tokens alone. Shared prompts are checked again on the families whose attention differs
(sliding windows, soft-capping, a second RoPE base, attention sinks) and on mixture-of-experts models. Tinker's
forward_backward packs its datums the same way: its logprobs, losses and gradients equal one datum at a time. The check
runs in its own process (megatron's parallel state)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_jobs import mpi_env

LOSS_REL = 1e-6
GRAD_REL = 1e-5


# Attention that differs from the tiny Llama's: Gemma 2 (soft-capped, alternating windows), Qwen3 with a window of 8
# on its upper layer, Gemma 3 (windows and a second RoPE base on the sliding layers); and megatron's MoE layers
# (Qwen3-MoE, no load-balancing loss trained: the default), where Tinker's packing is checked too; GPT-OSS (a sink
# key before a shared prompt's keys, alternating windows).
FAMILIES = ("gemma2", "qwen3-sliding", "gemma3", "qwen3-moe", "gpt-oss")


@pytest.fixture(scope="module")
def parity(tiny_model_dir: Path, family_models: dict[str, Path]) -> dict:
    script = Path(__file__).with_name("grpo_parity_check.py")
    models = [str(tiny_model_dir)] + [str(family_models[name]) for name in FAMILIES]
    proc = subprocess.run([sys.executable, str(script), *models], env=mpi_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_padding_free_grpo_gives_the_padded_loss_and_gradients(parity: dict, loss: str) -> None:
    r = parity[loss]
    assert len(r["lengths"]) > 3 and r["micro_batches"] > 1, r  # rows of different lengths, several micro-batches
    assert r["clipped_tokens"] > 0 and r["kl_sum"] > 0 and r["grad_norm"] > 0, r  # clipping and KL both act
    assert r["loss_free"] == pytest.approx(r["loss_padded"], rel=LOSS_REL), r
    assert r["grad_rel_max"] <= GRAD_REL, r


def test_padding_free_grpo_computes_no_padding(parity: dict) -> None:
    r, unshared = parity["grpo"], parity["grpo_unshared"]
    assert unshared["tokens_free"] == unshared["doc_tokens"] < r["tokens_padded"], r  # every token is a document's
    # ... each group's prompt once: every row's tokens but the prompts' repeats (all four groups share theirs)
    assert r["shared_tokens"] > 0 and r["tokens_free"] == r["doc_tokens"] - r["shared_tokens"], r
    # ... and only the completion tokens' positions go through the output layer (a prompt's logits are unused)
    assert r["head_rows_free"] == r["loss_tokens"] < r["tokens_free"], r


def test_without_shared_prompts_the_loss_and_gradients_are_the_same(parity: dict) -> None:
    r = parity["grpo_unshared"]
    assert r["shared_tokens"] == 0 and r["loss_tokens"] == parity["grpo"]["loss_tokens"], r
    assert r["loss_free"] == pytest.approx(r["loss_padded"], rel=LOSS_REL), r
    assert r["grad_rel_max"] <= GRAD_REL, r


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prompts_give_the_padded_loss_and_gradients_on_other_attention(parity: dict, family: str) -> None:
    r = parity[f"grpo:{family}"]
    assert r["shared_tokens"] > 0 and r["clipped_tokens"] > 0 and r["grad_norm"] > 0, r
    assert r["loss_free"] == pytest.approx(r["loss_padded"], rel=LOSS_REL), r
    assert r["grad_rel_max"] <= GRAD_REL, r


def test_rows_with_advantage_0_are_not_computed_and_change_nothing(parity: dict) -> None:
    """Without a KL term the rows whose group scored alike (advantage 0) are left out: the same loss, gradients,
    loss-token count and clipped tokens as computing every row, on fewer tokens. With KL they are computed."""
    r, with_kl = parity["grpo_no_kl"], parity["grpo"]
    assert r["rows_skipped"] == r["zero_advantage_docs"] == 2 and with_kl["rows_skipped"] == 0, r
    assert r["loss_free"] == pytest.approx(r["loss_padded"], rel=LOSS_REL, abs=1e-9), r
    assert r["grad_rel_max"] <= GRAD_REL and r["grad_norm"] > 0, r
    assert (r["loss_tokens"], r["clipped_tokens"]) == (r["loss_tokens_padded"], r["clipped_tokens_padded"]), r
    assert r["clipped_tokens"] > 0, r  # off-policy rows clip, so the clipped count is a real comparison
    assert r["tokens_free"] == r["doc_tokens"] - r["shared_tokens"] and r["doc_tokens"] < with_kl["doc_tokens"], r


@pytest.mark.parametrize("model", ["", ":qwen3-moe"], ids=["llama", "qwen3-moe"])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_tinker_forward_backward_packs_datums_and_shares_their_prompts_exactly(parity: dict, loss_fn: str,
                                                                               model: str) -> None:  # fmt: skip
    r = parity[f"tinker_{loss_fn}{model}"]
    assert r["shared_units"] == 4 and r["lengths_match"], r  # every prompt's datums as one shared-prefix document
    assert r["forward_passes"] < r["datums"] / 2, r  # packed: not one forward pass per datum
    assert r["loss"] == pytest.approx(r["loss_ref"], rel=LOSS_REL), r
    assert r["logp_diff"] <= 1e-5 and r["grad_rel_max"] <= GRAD_REL and r["grad_norm"] > 0, r


def test_tinker_forward_packs_on_a_moe_model_with_a_trained_balance_loss(parity: dict) -> None:
    """Routing is per token (top k, no dropping) and megatron adds the load-balancing loss only where a gradient is
    taken: on a MoE model trained with that loss, a forward without backward packs its datums and gives the logprobs
    and loss of one datum at a time; forward_backward still runs one datum per forward pass."""
    r = parity["tinker_balance:qwen3-moe"]
    assert r["forward_passes"] < r["datums"] / 2 and r["no_grads"], r
    assert r["forward_backward_passes"] == r["datums"], r
    assert r["logp_diff"] <= 1e-5 and r["logp_diff_backward"] <= 1e-5, r
    assert r["loss"] == pytest.approx(r["loss_ref"], rel=LOSS_REL), r
    assert r["loss_backward"] == pytest.approx(r["loss_ref"], rel=LOSS_REL), r
