"""Padding-free GRPO is the padded computation without the padding: on a fixed batch of scored rows of different
lengths, the trainer's packed micro-batches and GRPO loss give the padded layout's loss and gradients (per parameter,
fp32) while computing on about half the tokens, and running the output layer on the completion tokens alone. The
check runs in its own process (megatron's parallel state)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_jobs import mpi_env

LOSS_REL = 1e-6
GRAD_REL = 1e-5


@pytest.fixture(scope="module")
def parity(tiny_model_dir: Path) -> dict:
    script = Path(__file__).with_name("grpo_parity_check.py")
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir)], env=mpi_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo"])
def test_padding_free_grpo_gives_the_padded_loss_and_gradients(parity: dict, loss: str) -> None:
    r = parity[loss]
    assert len(r["lengths"]) > 3 and r["micro_batches"] > 1, r  # rows of different lengths, several micro-batches
    assert r["clipped_tokens"] > 0 and r["kl_sum"] > 0 and r["grad_norm"] > 0, r  # clipping and KL both act
    assert r["loss_free"] == pytest.approx(r["loss_padded"], rel=LOSS_REL), r
    assert r["grad_rel_max"] <= GRAD_REL, r


def test_padding_free_grpo_computes_no_padding(parity: dict) -> None:
    r = parity["grpo"]
    assert r["tokens_free"] == r["doc_tokens"] < r["tokens_padded"], r  # every computed token is a document's
    # ... and only the completion tokens' positions go through the output layer (a prompt's logits are unused)
    assert r["head_rows_free"] == r["loss_tokens"] < r["doc_tokens"], r


def test_rows_with_advantage_0_are_not_computed_and_change_nothing(parity: dict) -> None:
    """Without a KL term the rows whose group scored alike (advantage 0) are left out: the same loss, gradients,
    loss-token count and clipped tokens as computing every row, on fewer tokens. With KL they are computed."""
    r, with_kl = parity["grpo_no_kl"], parity["grpo"]
    assert r["rows_skipped"] == r["zero_advantage_docs"] == 2 and with_kl["rows_skipped"] == 0, r
    assert r["loss_free"] == pytest.approx(r["loss_padded"], rel=LOSS_REL, abs=1e-9), r
    assert r["grad_rel_max"] <= GRAD_REL and r["grad_norm"] > 0, r
    assert (r["loss_tokens"], r["clipped_tokens"]) == (r["loss_tokens_padded"], r["clipped_tokens_padded"]), r
    assert r["clipped_tokens"] > 0, r  # off-policy rows clip, so the clipped count is a real comparison
    assert r["tokens_free"] == r["doc_tokens"] < with_kl["doc_tokens"], (r, with_kl)
