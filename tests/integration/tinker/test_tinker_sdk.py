"""The real `tinker` SDK (PyPI 0.38) against a real `scalarlm serve` on the tiny model: the SL loop (LoRA and full
weights), the RL loop through a sampler of the published weights, and bad input as the SDK's own exceptions."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow

def _datum(tokens: list[int], first_target: int = 1) -> types.Datum:
    """Next-token prediction on `tokens`: input tokens[:-1], targets tokens[1:], weights 1 from `first_target`."""
    weights = [0.0] * (first_target - 1) + [1.0] * (len(tokens) - first_target)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def _sl_losses(training: Any, steps: int) -> list[float]:
    data = [_datum([5, 17, 23, 42, 7, 99, 3, 11]), _datum([8, 8, 30, 31, 32, 33, 34, 35])]
    losses = []
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
        out = fb.result()
        optim.result()
        losses.append(out.metrics["loss:sum"])
        assert len(out.loss_fn_outputs) == 2 and len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 7
    return losses


def test_sl_loop_lora_and_full(service: Any, tiny_model_dir: Path) -> None:
    base = service.get_server_capabilities().supported_models[0].model_name
    start = time.monotonic()
    lora = service.create_lora_training_client(base_model=base, rank=8).result()
    losses = _sl_losses(lora, 4)
    assert losses[-1] < losses[0] * 0.8, losses
    info = lora.get_info()
    assert info.is_lora and info.lora_rank == 8
    assert lora.get_tokenizer().encode("hello")
    full = service.create_lora_training_client(base_model=base, rank=8, user_metadata={"adapter_type": "full"}).result()
    full_losses = _sl_losses(full, 3)
    assert full_losses[-1] < full_losses[0] * 0.8, full_losses
    assert not full.get_info().is_lora
    print(f"SL loops: {time.monotonic() - start:.1f} s; lora {losses}; full {full_losses}")


PROMPT = [5, 17, 23, 42]
TARGET = 7  # the toy reward: how many sampled tokens are this one


def _rl_datum(completion: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """Prompt + completion as one sequence; only the completion's positions carry logprobs and the advantage."""
    tokens = PROMPT + completion
    n_prompt = len(PROMPT) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "logprobs": [0.0] * n_prompt + logprobs,
        "advantages": [0.0] * n_prompt + [advantage] * len(completion)})  # fmt: skip


def test_rl_loop_sampler_serves_new_weights(service: Any, server: tuple[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    start = time.monotonic()
    base = service.get_server_capabilities().supported_models[0].model_name
    training = service.create_lora_training_client(base_model=base, rank=8,
                                                   user_metadata={"adapter_type": "full"}).result()  # fmt: skip
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[])
    for step in range(3):
        result = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=4, sampling_params=params).result()
        seqs = result.sequences
        assert len(seqs) == 4 and all(len(s.tokens) == 6 and len(s.logprobs) == 6 for s in seqs)
        rewards = [sum(t == TARGET for t in s.tokens) / 6 for s in seqs]
        mean = sum(rewards) / len(rewards)
        data = [_rl_datum(s.tokens, s.logprobs, r - mean + 0.1) for s, r in zip(seqs, rewards)]
        out = training.forward_backward(data, "importance_sampling").result()
        if step == 0:  # same weights: the trainer's logprobs are the sampler's (importance ratio 1)
            trained = out.loss_fn_outputs[0]["logprobs"].tolist()[len(PROMPT) - 1:]
            assert trained == pytest.approx(seqs[0].logprobs, abs=2e-3)
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
    greedy = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result()
    model_id = training.get_info().model_id
    published = server[1] / "jobs" / model_id / "checkpoints" / "step-3"
    hf = AutoModelForCausalLM.from_pretrained(published, torch_dtype=torch.float32)
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(PROMPT):]
    assert greedy.sequences[0].tokens == expected.tolist()
    print(f"RL loop (3 steps, sampler per step): {time.monotonic() - start:.1f} s")


def test_bad_input_is_the_sdks_exceptions(service: Any, server: tuple[str, Path]) -> None:
    base = service.get_server_capabilities().supported_models[0].model_name
    training = service.create_lora_training_client(base_model=base, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="vocabulary"):
        training.forward_backward([_datum([5, 10**6, 3])], "cross_entropy").result()
    with pytest.raises(tinker.TinkerError, match="gspo"):
        training.forward_backward([_datum([5, 6, 3])], "gspo").result()
    # a loss setting we do not read is refused, not ignored (a misspelt key, a text value)
    with pytest.raises(tinker.TinkerError, match="'clip_ratio' is not read by 'ppo'"):
        training.forward_backward([_datum([5, 6, 3])], "ppo", loss_fn_config={"clip_ratio": 0.2}).result()
    with pytest.raises(tinker.TinkerError, match="must be a finite number"):
        training.forward_backward([_datum([5, 6, 3])], "cispo", loss_fn_config={"clip_high_threshold": "x"}).result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn_inputs"):
        training.forward_backward([_datum([5, 6, 3])], "importance_sampling").result()
    # Nothing else is affected: the same training client still trains.
    assert training.forward_backward([_datum([5, 6, 3])], "cross_entropy").result().metrics["loss:sum"] > 0
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.AuthenticationError, match="invalid API key"):
        tinker.ServiceClient(base_url=server[0], api_key="tml-not-our-key").create_lora_training_client(
            base_model=base, rank=4).result()  # fmt: skip


def test_rl_reward_rises_on_a_toy_task(service: Any) -> None:
    """The RL loop on a toy task: reward = the share of sampled tokens in the lower half of the vocabulary (about
    0.5 for the random base model). Sampling from each step's new weights, the reward rises."""
    start = time.monotonic()
    base = service.get_server_capabilities().supported_models[0].model_name
    training = service.create_lora_training_client(base_model=base, rank=8,
                                                   user_metadata={"adapter_type": "full"}).result()  # fmt: skip
    sampler = training.save_weights_and_get_sampling_client().result()
    means = []
    for step in range(6):
        params = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[], seed=step)
        seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=8, sampling_params=params).result().sequences
        rewards = [sum(t < 256 for t in s.tokens) / len(s.tokens) for s in seqs]
        means.append(sum(rewards) / len(rewards))
        data = [_rl_datum(s.tokens, s.logprobs, r - means[-1]) for s, r in zip(seqs, rewards)]
        training.forward_backward(data, "importance_sampling")
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
    print(f"RL toy task, 6 steps: {time.monotonic() - start:.1f} s; mean reward per step {means}")
    assert sum(means[-2:]) / 2 > max(0.75, means[0] + 0.2), means
