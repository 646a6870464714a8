"""A GRPO training job (LoRA, KL to the adapter-free base) through the entry point: whole groups per step, GRPO
metrics, and the rewarded completion becomes more likely than the unrewarded one under the published adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_jobs import make_job, run_trainer, trainer_output

from scalarlm.checkpoint import latest_step, read_manifest

PROMPTS = ["2+2=", "3+3=", "1+4="]
GOOD, BAD = " yes", " no"


def _rows() -> list[dict]:
    rows = []
    for p in PROMPTS:
        rows += [{"prompt": p, "completion": GOOD, "reward": 1.0}, {"prompt": p, "completion": BAD, "reward": 0.0}]
        rows += [{"prompt": p, "completion": BAD + "!", "reward": 0.0}]
    return rows


def _margin(model, tokenizer, prompt: str) -> float:
    """log p(GOOD) - log p(BAD) after `prompt`."""

    def logp(completion: str) -> float:
        p = tokenizer(prompt, return_tensors="pt").input_ids
        c = tokenizer(completion, add_special_tokens=False, return_tensors="pt").input_ids
        ids = torch.cat([p, c], dim=1)
        with torch.no_grad():
            logits = model(ids).logits.log_softmax(-1)
        return float(logits[0, p.shape[1] - 1 : -1].gather(-1, c[0, :, None]).sum())

    return logp(GOOD) - logp(BAD)


@pytest.mark.parametrize("model", ["llama", "qwen3-moe"])
def test_grpo_lora_job_prefers_rewarded_completions(tmp_path: Path, tiny_model_dir: Path, model: str,
                                                    family_models: dict[str, Path]) -> None:  # fmt: skip
    """On a mixture-of-experts model the adapter is on the attention (its default targets), two steps per batch with
    routing replay."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny_model_dir = tiny_model_dir if model == "llama" else family_models[model]
    moe = {"routing_replay": True, "num_iterations": 2} if model != "llama" else {}
    job = make_job(
        tmp_path, "grpo-job", tiny_model_dir, _rows(), max_steps=12, learning_rate=1e-2, batch_size=3, loss="grpo",
        kl_coef=0.01, adapter_type="lora", lr_schedule="constant", steps_per_checkpoint=12, **moe,
    )  # fmt: skip
    assert run_trainer(job) == 0, trainer_output(job)
    assert job.read_status().status == "COMPLETED"
    metrics = job.read_metrics()
    assert len(metrics) == 12
    for m in metrics:
        assert m["rows"] == 9 and m["groups"] == 3  # batch_size 3 = three whole groups per step
        assert m["reward_mean"] == 1 / 3 and "kl" in m and "clip_fraction" in m and "advantage_std" in m
    assert metrics[0]["kl"] == 0.0 and metrics[-1]["kl"] > 0.0
    assert read_manifest(job, latest_step(job)).kind == "lora"

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    before = [_margin(base, tokenizer, p) for p in PROMPTS]
    tuned = PeftModel.from_pretrained(base, str(job.step_dir(12))).eval()
    after = [_margin(tuned, tokenizer, p) for p in PROMPTS]
    assert all(a > b + 1.0 for a, b in zip(after, before)), (before, after)


def _batches() -> list[dict]:
    """Six prompts in groups of three; the two halves' mean rewards differ, so a metrics row names its batch."""
    rows = []
    for i, prompt in enumerate(["2+2=", "3+3=", "1+4=", "5+1=", "2+5=", "4+4="]):
        rows += [{"prompt": prompt, "completion": GOOD, "reward": 1.0 + i // 3},
                 {"prompt": prompt, "completion": BAD, "reward": 0.0}]  # fmt: skip
    return rows


MU = dict(loss="grpo", num_iterations=3, batch_size=3, learning_rate=1e-2, lr_schedule="constant", adapter_type="full",
          shuffle=False, max_seq_len=32)  # fmt: skip


def test_num_iterations_trains_each_batch_several_steps_and_a_resume_inside_a_batch_takes_it_again(
        tmp_path: Path, tiny_model_dir: Path) -> None:  # fmt: skip
    """num_iterations 3: steps 1-3 train the first batch of groups, 4-6 the second. A job whose state was saved after
    step 4 (inside the second batch) resumes with the second batch again for steps 5 and 6, as the uninterrupted
    job trains them; the later steps of a batch clip tokens the policy moved (their old logprobs are the first
    step's: the rows carry no sampling logprobs)."""
    whole = make_job(tmp_path, "mu-whole", tiny_model_dir, _batches(), max_steps=6, steps_per_checkpoint=6, **MU)
    assert run_trainer(whole) == 0, trainer_output(whole)
    rows = whole.read_metrics()
    assert [r["batch_step"] for r in rows] == [1, 2, 3, 1, 2, 3]
    means = [r["reward_mean"] for r in rows]
    assert means[0] == means[1] == means[2] != means[3] == means[4] == means[5]
    assert rows[0]["clip_fraction"] == 0 and any(r["clip_fraction"] > 0 for r in rows[1:3] + rows[4:6]), rows

    split = make_job(tmp_path, "mu-split", tiny_model_dir, _batches(), max_steps=4, steps_per_checkpoint=4, **MU)
    assert run_trainer(split) == 0, trainer_output(split)  # ends with its state saved at step 4, inside batch two
    config = split.read_config()
    split.write_config(config.model_copy(update={"train_args": config.train_args.model_copy(update={"max_steps": 6})}))
    assert run_trainer(split) == 0, trainer_output(split)
    resumed = split.read_metrics()
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["reward_mean"] for r in resumed] == means and [r["batch_step"] for r in resumed[4:]] == [2, 3]
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 for a, b in zip(resumed[:4], rows[:4]))


def test_dr_grpo_divides_by_max_completion_length(tmp_path: Path, tiny_model_dir: Path) -> None:
    """dr_grpo's constant normaliser is TRL's `max_completion_length` when given, else the batch's longest completion:
    on the same first step (ratio 1, the same advantages) the loss and the gradient scale by longest / 64."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    longest = max(len(tok(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in _rows())  # + EOS
    firsts = []
    for name, more in (("batch-longest", {}), ("constant", {"max_completion_length": 64})):
        job = make_job(tmp_path, name, tiny_model_dir, _rows(), max_steps=1, batch_size=3, loss="dr_grpo",
                       adapter_type="full", lr_schedule="constant", **more)  # fmt: skip
        assert run_trainer(job) == 0, trainer_output(job)
        firsts.append(job.read_metrics()[0])
    ratio = longest / 64
    assert firsts[0]["grad_norm"] > 0 and firsts[0]["loss"] != 0
    assert firsts[1]["grad_norm"] == pytest.approx(firsts[0]["grad_norm"] * ratio, rel=1e-5), firsts
    assert firsts[1]["loss"] == pytest.approx(firsts[0]["loss"] * ratio, rel=1e-5), firsts


def test_scale_rewards_batch_divides_by_the_std_of_every_reward_of_the_step(tmp_path: Path, tiny_model_dir: Path
                                                                            ) -> None:  # fmt: skip
    """TRL's `scale_rewards: "batch"` on dr_grpo (unscaled by default): the same first step (ratio 1, no KL) has its
    loss and gradient divided by the std of the step's rewards (NumPy), where each group's own std would differ."""
    import numpy as np

    firsts = []
    for name, more in (("unscaled", {}), ("batch", {"scale_rewards": "batch"})):
        job = make_job(tmp_path, name, tiny_model_dir, _rows(), max_steps=1, batch_size=3, loss="dr_grpo",
                       adapter_type="full", lr_schedule="constant", max_completion_length=64, **more)  # fmt: skip
        assert run_trainer(job) == 0, trainer_output(job)
        firsts.append(job.read_metrics()[0])
    rewards = np.array([r["reward"] for r in _rows()])  # the step's 3 groups: every row
    factor = 1 / (rewards.std(ddof=1) + 1e-4)
    assert abs(factor - 1 / (rewards[:3].std(ddof=1) + 1e-4)) > 0.1  # a group's std would give another factor
    assert firsts[0]["grad_norm"] > 0 and firsts[0]["loss"] != 0
    assert firsts[1]["grad_norm"] == pytest.approx(firsts[0]["grad_norm"] * factor, rel=1e-5), firsts
    assert firsts[1]["loss"] == pytest.approx(firsts[0]["loss"] * factor, rel=1e-5), firsts


def test_importance_sampling_level_sequence_takes_one_ratio_per_completion(tmp_path: Path, tiny_model_dir: Path
                                                                           ) -> None:  # fmt: skip
    """TRL's `importance_sampling_level: "sequence"` (GSPO) reaches the trainer: on the same first step, with sampling
    logprobs far from the model's, each completion's tokens share one ratio, so the loss differs from the per-token
    ratios' (tests/unit/training/test_grpo.py compares both with NumPy)."""
    rows = []
    for p in PROMPTS:
        rows += [{"prompt": p, "completion": "", "completion_token_ids": [40, 41, 42], "logprobs": [-1.0, -9.0, -3.0],
                  "reward": float(r)} for r in (1, 0, 0)]  # fmt: skip
    firsts = []
    for level in ("token", "sequence"):
        job = make_job(tmp_path, level, tiny_model_dir, rows, max_steps=1, batch_size=3, loss="grpo", clip_eps=10.0,
                       adapter_type="full", lr_schedule="constant", importance_sampling_level=level)  # fmt: skip
        assert run_trainer(job) == 0, trainer_output(job)
        firsts.append(job.read_metrics()[0])
    assert all(m["logprobs_mismatched_rows"] == 0 for m in firsts)
    assert firsts[0]["loss"] != pytest.approx(firsts[1]["loss"], rel=1e-3), firsts


def test_mask_truncated_completions_leaves_the_completions_at_max_tokens_out_of_the_loss(tmp_path: Path,
                                                                                        tiny_model_dir: Path) -> None:
    """TRL's mask_truncated_completions on a real dr_grpo job: the first step's loss (ratio 1, no KL) is
    -sum(len_i x A_i) / (64 x N) over the completions that did not stop at max_tokens (NumPy), every row's reward in
    its group's advantage; without the setting, over every completion."""
    import numpy as np
    from transformers import AutoTokenizer

    rows = [{**r, "finish_reason": "length" if r["completion"].endswith("!") else "stop"} for r in _rows()]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    lengths = np.array([len(tok(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in rows])
    rewards = np.array([r["reward"] for r in rows]).reshape(3, 3)
    adv = (rewards - rewards.mean(1, keepdims=True)).ravel()  # dr_grpo: centred, unscaled
    kept = np.array([r["finish_reason"] == "stop" for r in rows])
    losses = {}
    for name, mask in (("every", False), ("masked", True)):
        job = make_job(tmp_path, name, tiny_model_dir, rows, max_steps=1, batch_size=3, loss="dr_grpo",
                       max_completion_length=64, adapter_type="full", lr_schedule="constant",
                       mask_truncated_completions=mask)  # fmt: skip
        assert run_trainer(job) == 0, trainer_output(job)
        first = job.read_metrics()[0]
        assert first["rows_at_max_tokens"] == 3
        losses[name] = first["loss"]
    assert losses["every"] == pytest.approx(-(lengths * adv).sum() / (64 * 9), rel=1e-5)
    assert losses["masked"] == pytest.approx(-(lengths * adv * kept).sum() / (64 * 9), rel=1e-5)
    assert abs(losses["masked"] - losses["every"]) > 1e-4


def _model_logprobs(model_dir: Path, prompts: list[str], completion: list[int]) -> "np.ndarray":
    """The model's logprobs of `completion` after each prompt, [prompts, tokens] (transformers, float32)."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for prompt in prompts:
        p = tok(prompt, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([p + completion])).logits.double().log_softmax(-1)
        out.append([float(logits[0, len(p) - 1 + j, t]) for j, t in enumerate(completion)])
    return np.array(out)


@pytest.mark.parametrize("setting", ["cispo", "sapo", "token_truncate", "sequence_mask", "delta", "off_policy"])
def test_a_real_jobs_first_loss_is_each_policy_objective(tmp_path: Path, tiny_model_dir: Path, setting: str) -> None:
    """Loss 'cispo' / 'sapo', TRL's vllm_importance_sampling_correction, delta and off_policy_mask_threshold reach the
    trainer: the first step's loss of a real job equals NumPy's on the model's own logprobs (transformers) and the
    rows' sampling logprobs."""
    import numpy as np

    tokens, sampled = [40, 41, 42], np.array([-4.0, -9.0, -5.0])  # ratios both sides of 1 and of every bound
    rows = [{"prompt": p, "completion": "", "completion_token_ids": tokens, "logprobs": sampled.tolist(),
             "reward": float(r)} for p in PROMPTS for r in (1, 0, 0)]  # fmt: skip
    lp = _model_logprobs(tiny_model_dir, [r["prompt"] for r in rows], tokens)  # [9, 3]
    rewards = np.array([r["reward"] for r in rows]).reshape(3, 3)
    a = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(9, 1)
    r = np.exp(lp - sampled)
    assert (r < 0.5).any() and (r > 5).any()
    more: dict = {"loss": setting} if setting in ("cispo", "sapo") else {"loss": "grpo"}
    if setting in ("token_truncate", "sequence_mask"):
        more.update(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=setting,
                    vllm_importance_sampling_clip_max=2.0, vllm_importance_sampling_clip_min=0.3)
    clipped = -np.minimum(r * a, np.clip(r, 0.8, 1.2) * a)  # grpo's clipped term (clip_eps 0.2)
    if setting == "delta":
        more["delta"] = 1.5
        assert ((r > 1.5) & (a < 0)).any()  # the cap binds where the unclipped term would grow
        want = (-np.minimum(np.minimum(r, 1.5) * a, np.clip(r, 0.8, 1.2) * a)).mean()
    elif setting == "off_policy":
        drift = (sampled - lp).mean(1, keepdims=True)  # per completion: mean of (sampling - policy logprob)
        high = np.sort(np.unique(drift.round(6)))[-2:]  # between the two largest: no completion at the threshold
        more["off_policy_mask_threshold"] = threshold = float(high.mean())
        keep = (a >= 0) | (drift <= threshold)
        assert not keep.all() and (~keep | (a >= 0)).any()
        want = (clipped * keep).mean()
    elif setting == "cispo":
        more["clip_eps_high"] = 5.0
        want = (-np.minimum(r, 5.0) * a * lp).sum() / lp.size  # dapo's weights: every token alike
    elif setting == "sapo":
        t = np.where(a > 0, 1.0, 1.05)
        want = (-(1 / (1 + np.exp(-t * (r - 1)))) * 4 / t * a).mean()  # grpo's: tokens, then rows
    else:  # ratio 1 against the trainer's own logprobs; the objective times the sampler correction
        if setting == "token_truncate":
            weight = np.clip(r, 0.3, 2.0)
        else:  # one weight per completion: exp of its summed log ratios, 0 outside [0.3, 2]
            weight = np.exp((lp - sampled).sum(1, keepdims=True)) * np.ones_like(lp)
            weight = np.where((weight < 0.3) | (weight > 2.0), 0.0, weight)
            assert (weight == 0).any() and (weight > 0).any()
        want = (-a * weight).mean()
    job = make_job(tmp_path, setting, tiny_model_dir, rows, max_steps=1, batch_size=3, adapter_type="full",
                   lr_schedule="constant", **more)  # fmt: skip
    assert run_trainer(job) == 0, trainer_output(job)
    first = job.read_metrics()[0]
    assert first["logprobs_mismatched_rows"] == 0
    assert first["loss"] == pytest.approx(want, rel=1e-4, abs=1e-6), (first, want)
    if setting == "off_policy":
        assert first["off_policy_masked_fraction"] == pytest.approx(1 - keep.mean())
    if setting in ("token_truncate", "sequence_mask"):
        assert first["importance_sampling_ratio_mean"] == pytest.approx(weight.mean(), rel=1e-4)
        assert first["importance_sampling_masked_fraction"] == pytest.approx((weight == 0).mean())
