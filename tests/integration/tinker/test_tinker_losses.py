"""Every built-in loss, `forward` and `compute_logprobs` through the real `tinker` SDK, each equal to an independent
computation on the same inputs: `transformers` logprobs of the base weights, and the loss written out in NumPy from
Tinker's documented formulas (parity is the proof)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow

SEQUENCES = [[5, 17, 23, 42, 7, 99, 3, 11, 64], [8, 8, 30, 31, 32, 33, 34]]
# Sampling logprobs = the model's own plus these offsets, so ratios fall below, inside and above the clip range.
OFFSETS = np.array([-0.6, -0.25, -0.05, 0.0, 0.05, 0.15, 0.3, 0.7])
ATOL = 2e-5  # megatron fp32 vs transformers fp32 on the same weights: ~1e-6 measured


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir: Path) -> list[np.ndarray]:
    """transformers' logprob of each next token, per sequence (float64)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq in SEQUENCES:
            logits = model(torch.tensor([seq[:-1]])).logits[0].double()
            out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:]).unsqueeze(1))[:, 0].numpy())
    return out


def _inputs(i: int, logp: np.ndarray) -> dict[str, np.ndarray]:
    n = len(logp)
    rng = np.random.default_rng(i)
    return {"target_tokens": np.array(SEQUENCES[i][1:]), "weights": np.array([0.0] + [1.0] * (n - 1)),
            "logprobs": logp + OFFSETS[:n], "advantages": rng.choice([-1.5, -0.5, 0.5, 2.0], size=n)}  # fmt: skip


def _numpy_loss(loss_fn: str, logp: np.ndarray, x: dict[str, np.ndarray], config: dict[str, float]) -> np.ndarray:
    """Per-token loss, written from Tinker's loss docs."""
    if loss_fn == "cross_entropy":
        return -logp * x["weights"]
    ratio, adv = np.exp(logp - x["logprobs"]), x["advantages"]
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if loss_fn == "importance_sampling":
        return -ratio * adv
    if loss_fn == "ppo":
        return -np.minimum(ratio * adv, np.clip(ratio, low, high) * adv)
    if loss_fn == "cispo":
        return -np.clip(ratio, low, high) * logp * adv
    if loss_fn == "dro":
        return -(logp * adv - 0.5 * config.get("beta", 0.05) * (logp - x["logprobs"]) ** 2)
    raise AssertionError(loss_fn)


def _data(loss_fn: str, hf: list[np.ndarray]) -> list[types.Datum]:
    data = []
    for i, seq in enumerate(SEQUENCES):
        x = _inputs(i, hf[i])
        keep = ("target_tokens", "weights") if loss_fn == "cross_entropy" else ("target_tokens", "logprobs", "advantages")
        inputs = {k: (x[k].astype(np.int64) if k == "target_tokens" else x[k].astype(np.float32)) for k in keep}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()}))  # fmt: skip
    return data


@pytest.fixture(scope="module")
def base_client(service: Any) -> Any:
    """A full-weights training client that has not stepped: its weights are the base model's."""
    base = service.get_server_capabilities().supported_models[0].model_name
    return service.create_lora_training_client(base_model=base, rank=8, user_metadata={"adapter_type": "full"}).result()


CASES = [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
         ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), ("cispo", {}),
         ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.05}), ("dro", {}), ("dro", {"beta": 0.3})]  # fmt: skip


def test_forward_losses_equal_numpy(base_client: Any, hf_logprobs: list[np.ndarray]) -> None:
    start = time.monotonic()
    for loss_fn, config in CASES:
        out = base_client.forward(_data(loss_fn, hf_logprobs), loss_fn, loss_fn_config=config or None).result()
        expected_sum = 0.0
        for i, got in enumerate(out.loss_fn_outputs):
            logp = hf_logprobs[i]
            np.testing.assert_allclose(got["logprobs"].to_numpy(), logp, atol=ATOL, err_msg=loss_fn)
            expected = _numpy_loss(loss_fn, logp, _inputs(i, logp), config)
            np.testing.assert_allclose(got["elementwise_loss"].to_numpy(), expected, atol=5 * ATOL,
                                       err_msg=f"{loss_fn} {config}")  # fmt: skip
            expected_sum += expected.sum()
        assert out.metrics["loss:sum"] == pytest.approx(expected_sum, abs=1e-4), (loss_fn, config)
    print(f"forward, {len(CASES)} loss cases: {time.monotonic() - start:.1f} s")


def test_forward_backward_reports_what_forward_does(base_client: Any, hf_logprobs: list[np.ndarray]) -> None:
    """forward_backward's outputs are forward's on the same weights; without optim_step the weights stay."""
    data = _data("ppo", hf_logprobs)
    fb = base_client.forward_backward(data, "ppo").result()
    fwd = base_client.forward(data, "ppo").result()
    assert fb.metrics["loss:sum"] == pytest.approx(fwd.metrics["loss:sum"], abs=1e-6)
    for a, b in zip(fb.loss_fn_outputs, fwd.loss_fn_outputs):
        np.testing.assert_allclose(a["elementwise_loss"].to_numpy(), b["elementwise_loss"].to_numpy(), atol=1e-6)


def test_compute_logprobs_equals_transformers(service: Any, hf_logprobs: list[np.ndarray]) -> None:
    start = time.monotonic()
    base = service.get_server_capabilities().supported_models[0].model_name
    sampler = service.create_sampling_client(base_model=base)
    for seq, expected in zip(SEQUENCES, hf_logprobs):
        got = sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result()
        assert got[0] is None and len(got) == len(seq)
        np.testing.assert_allclose(np.array(got[1:], dtype=np.float64), expected, atol=ATOL)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(SEQUENCES[0]), prompt_logprobs_last_n=3).result()
    assert all(v is None for v in last[:-3])
    np.testing.assert_allclose(np.array(last[-3:], dtype=np.float64), hf_logprobs[0][-3:], atol=ATOL)
    print(f"compute_logprobs: {time.monotonic() - start:.1f} s")
