"""Run by test_grpo_padding_free.py (one process): padding-free GRPO micro-batches against the padded layout.

`grpo_parity_check.py MODEL [FAMILY_MODEL ...]`: every case below on MODEL; the shared-prompt case again on each
FAMILY_MODEL (sliding windows, soft-capped attention, per-layer RoPE bases), keyed "grpo:<its folder name>".

On a real megatron model (and a second, perturbed one as the KL reference) and a fixed batch of scored rows of
different lengths (some with sampling logprobs far enough off-policy to clip, some on-policy, one group with equal
rewards), computes the GRPO loss (+ KL) and its gradients twice:

* padding-free: the trainer's own `grpo.rl_micro_batches` (documents packed end to end into [1, T] rows, attention
  within each document; the rows of a prompt as one shared-prefix document, the prompt computed once, except in the
  `_unshared` case) and `rl_step.grpo_loss`, over several micro-batches, gradients accumulated, with the
  output layer run only at the loss positions (`token_losses(..., loss_only=True)`, as the step driver runs it);
* padded (the reference, written here as the trainer had it): one document per row, padded to a common length with a
  [B, 1, L, L] mask, advantages / sampling logprobs / weights placed per row, the same objective.

Without a KL term (`grpo_no_kl`) the padding-free side also leaves out the rows with advantage 0, as `rl_step.rl_batch`
does (`grpo.with_gradient`); the padded reference still computes every row.

Prints one JSON line per case: both losses, the largest per-parameter relative gradient difference
(||g_free - g_padded|| / ||g_padded||), the tokens each layout computed on, how many micro-batches each used and
how many positions went through the padding-free side's output layer.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

MAX_LEN = 64
KL_COEF = 0.05
CLIP = 0.2


def rows(tokenizer) -> list[dict]:
    """Scored rows of different lengths in three groups; logprobs off-policy by up to +-0.6 nats."""
    gen = torch.Generator().manual_seed(1)
    texts = [" yes", " no thanks", " maybe later today, maybe never", " 4", " four, I think, or five",
             " the answer is 4 and nothing else will do here", " ok", " ok ok"]  # fmt: skip
    out = []
    for i, text in enumerate(texts):
        group = ["2+2=", "What is two plus two? Answer briefly: ", "x"][i % 3]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        row = {"prompt": group, "completion": text, "completion_token_ids": ids, "reward": float(i % 4)}
        if i % 4 != 3:  # every fourth row trains on-policy (no sampling logprobs)
            row["logprobs"] = (-torch.rand(len(ids), generator=gen) * 3).tolist()
        out.append(row)
    out.append({"prompt": "same", "completion": " a", "reward": 1.0})
    out.append({"prompt": "same", "completion": " b c", "reward": 1.0})  # equal rewards: zero advantage
    return out


def load_model(model_dir: Path, noise: float = 0.0, aux_loss_coef: float = 0.0):
    from scalarlm.training import hf_io
    from scalarlm.training.convert import hf_to_mcore
    from scalarlm.training.model import build_gpt_model, model_arch

    arch = model_arch(model_dir)
    model = build_gpt_model(arch, 1, bf16=False, aux_loss_coef=aux_loss_coef)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, value in hf_to_mcore(hf_io.load_weights(model_dir), arch, 0, 1).items():
            params[name].copy_(value + noise * torch.randn(value.shape, generator=gen) * value.std().nan_to_num())
    return model


def padded_micro_batch(docs, weights, pad_id: int):
    """The padded reference layout: one document per row, per-row advantages, logprobs, weights."""
    from scalarlm.training.data import Block, collate

    mb = collate([Block(d.doc.tokens, d.doc.targets, (0,)) for d in docs], pad_id)
    adv, old, has_old, w = (torch.zeros(mb.labels.shape) for _ in range(4))
    for b, d in enumerate(docs):
        positions = [p for p in range(1, len(d.doc.tokens)) if d.doc.targets[p]]
        for j, p in enumerate(positions):
            adv[b, p - 1], w[b, p - 1] = d.advantage, weights[b]
            if d.old_logprobs is not None:
                k = len(d.old_logprobs) - len(positions) + j
                if 0 <= k < len(d.old_logprobs):
                    old[b, p - 1], has_old[b, p - 1] = d.old_logprobs[k], 1.0
    return mb, adv, old, has_old, w


def padded_loss(model, ref_model, docs, weights, pad_id: int, kl_coef: float) -> tuple[torch.Tensor, dict, int]:
    from scalarlm.training.grpo import Objective, grpo_objective
    from scalarlm.training.losses import token_losses

    mb, adv, old, has_old, w = padded_micro_batch(docs, weights, pad_id)
    ref = None
    if kl_coef > 0:
        with torch.no_grad():
            ref = -token_losses(ref_model, mb).float()
    logp = -token_losses(model, mb).float()
    loss, stats = grpo_objective(logp, old, has_old, adv, w, mb.loss_mask, Objective(CLIP, kl_coef=kl_coef), ref)
    return loss, stats, int(mb.tokens.numel())


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def tinker_datums(tokenizer) -> list[dict]:
    """The rows above as Tinker datums (input = prompt + completion but the last token, targets = the next tokens),
    with per-token advantages and sampling logprobs (0 on the prompt, as the Tinker cookbook sends them)."""
    out = []
    for i, row in enumerate(rows(tokenizer)):
        prompt = tokenizer(row["prompt"])["input_ids"]
        text_ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        completion = row.get("completion_token_ids") or text_ids
        ids = prompt + completion
        n, p = len(ids) - 1, len(prompt) - 1
        adv = [0.0] * p + [(-1.0) ** i * (0.3 + 0.1 * i)] * (n - p)
        old = [0.0] * p + [-1.5 - 0.05 * (i + j) for j in range(n - p)]
        out.append({"tokens": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "advantages": adv, "logprobs": old,
                                                           "weights": [0.0] * p + [1.0] * (n - p)}})  # fmt: skip
    return out


def _stand_in(model, tokenizer, aux_loss_coef: float = 0.0) -> SimpleNamespace:
    """What tinker_ops.forward_backward reads of a Trainer, around `model` on one rank."""
    from scalarlm.protocol.training import TrainArgs

    model.no_sync = contextlib.nullcontext  # what forward_backward calls on the DDP wrapper (one rank: no sync)
    return SimpleNamespace(ddp=model, par=SimpleNamespace(device=torch.device("cpu"), dp_rank=0, dp_size=1),
                           arch=SimpleNamespace(vocab_size=len(tokenizer), longrope=None), max_len=16,
                           args=TrainArgs(moe_aux_loss_coef=aux_loss_coef))  # fmt: skip


def _one_datum_at_a_time(model, data: list[dict], loss_fn: str, backward: bool) -> tuple[float, list[torch.Tensor]]:
    """The reference: each datum in a forward pass of its own; (summed loss, each datum's logprobs)."""
    from scalarlm.training.data import MicroBatch
    from scalarlm.training.losses import token_losses
    from scalarlm.training.tinker_ops import _loss, loss_inputs

    ref_loss, ref_logp = 0.0, []
    for i, d in enumerate(data):
        n = len(d["tokens"])
        row = lambda xs: torch.tensor(xs, dtype=torch.long).unsqueeze(0)  # noqa: E731
        mb = MicroBatch(row(d["tokens"]), row(d["loss_fn_inputs"]["target_tokens"]), torch.ones(1, n),
                        row(list(range(n))), None, (0, n))  # fmt: skip
        with contextlib.nullcontext() if backward else torch.no_grad():
            logp = -token_losses(model, mb).float()[0]
            loss = _loss(loss_fn, logp, loss_inputs(loss_fn, d, n, i, {}), {}).sum()
        if backward:
            loss.backward()
        ref_loss += float(loss.detach())
        ref_logp.append(logp.detach())
    return ref_loss, ref_logp


def _logp_diff(outputs: list[dict], ref_logp: list[torch.Tensor]) -> float:
    return max(float((torch.tensor(o["logprobs"]) - r).abs().max()) for o, r in zip(outputs, ref_logp))


def _counting_forwards(model, run):
    """(run(), the number of forward passes of `model` it made)."""
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        return run(), len(calls)
    finally:
        hook.remove()


def tinker_cases(model, tokenizer, suffix: str = "") -> dict:
    """Tinker's forward_backward (packed; datums of one prompt share it) against one datum at a time: logprobs,
    losses and gradients, for cross_entropy and ppo (keys `tinker_<loss><suffix>`)."""
    from scalarlm.training.tinker_ops import datum_units, forward_backward

    data = tinker_datums(tokenizer)
    trainer = _stand_in(model, tokenizer)
    pairs = [list(zip(d["tokens"], d["loss_fn_inputs"]["target_tokens"])) for d in data]
    out = {}
    for loss_fn in ("cross_entropy", "ppo"):
        packed, forwards = _counting_forwards(
            model, lambda: forward_backward(trainer, {"loss_fn": loss_fn, "data": data}, backward=True))
        packed_grads = grads(model)
        ref_loss, ref_logp = _one_datum_at_a_time(model, data, loss_fn, backward=True)
        ref_grads = grads(model)
        rel = {n: float((packed_grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items()}
        out[f"tinker_{loss_fn}{suffix}"] = {
            "loss": packed["loss"], "loss_ref": ref_loss, "forward_passes": forwards, "datums": len(data),
            "logp_diff": _logp_diff(packed["outputs"], ref_logp),
            "grad_rel_max": max(rel.values()),
            "grad_norm": float(torch.stack([g.norm() for g in ref_grads.values()]).norm()),
            "shared_units": sum(len(u) > 1 for u in datum_units(pairs, 16 * 8)),
            "lengths_match": all(len(o["logprobs"]) == len(d["tokens"]) for o, d in zip(packed["outputs"], data)),
        }  # fmt: skip
    return out


def tinker_balance_loss_cases(model, tokenizer, aux_loss_coef: float, suffix: str) -> dict:
    """On a MoE model built with a trained load-balancing loss (`aux_loss_coef` > 0): Tinker's `forward` (no
    gradient) packs and gives the logprobs and loss of one datum at a time; `forward_backward` still runs one datum
    per forward pass, with the same loss (key `tinker_balance<suffix>`)."""
    from scalarlm.training.tinker_ops import forward_backward

    data = tinker_datums(tokenizer)
    trainer = _stand_in(model, tokenizer, aux_loss_coef)
    request = {"loss_fn": "ppo", "data": data}
    forward, forward_passes = _counting_forwards(model, lambda: forward_backward(trainer, request, backward=False))
    no_grads = all(p.grad is None for p in model.parameters())
    both, both_passes = _counting_forwards(model, lambda: forward_backward(trainer, request, backward=True))
    model.zero_grad(set_to_none=True)
    ref_loss, ref_logp = _one_datum_at_a_time(model, data, "ppo", backward=False)
    return {f"tinker_balance{suffix}": {
        "datums": len(data), "forward_passes": forward_passes, "forward_backward_passes": both_passes,
        "loss": forward["loss"], "loss_backward": both["loss"], "loss_ref": ref_loss, "no_grads": no_grads,
        "logp_diff": _logp_diff(forward["outputs"], ref_logp),
        "logp_diff_backward": _logp_diff(both["outputs"], ref_logp),
    }}  # fmt: skip


def main() -> int:
    from transformers import AutoTokenizer

    from scalarlm.protocol.training import TrainArgs
    from scalarlm.training.grpo import (encode_rl_rows, parse_rl_rows, prompt_units, rl_micro_batches,
                                        shared_prompt_tokens, token_weights, with_gradient)
    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.losses import token_losses
    from scalarlm.training.model import model_arch
    from scalarlm.training.parallel import init_parallel, shutdown_parallel
    from scalarlm.training.rl_step import STATS, RLBatch, grpo_loss

    init_parallel(launch_env_from(os.environ), 1, seed=0)
    try:
        result = {}
        # (name, model, loss, KL coefficient, shared prompts): with KL every row is computed; without, rows with
        # advantage 0 are left out
        first = Path(sys.argv[1])
        cases = [("grpo", first, "grpo", KL_COEF, True), ("dr_grpo", first, "dr_grpo", KL_COEF, True),
                 ("dapo", first, "dapo", KL_COEF, True), ("grpo_no_kl", first, "grpo", 0.0, True),
                 ("grpo_unshared", first, "grpo", KL_COEF, False)]
        cases += [(f"grpo:{Path(d).name}", Path(d), "grpo", KL_COEF, True) for d in sys.argv[2:]]
        loaded: Path | None = None
        for case, model_dir, loss_type, kl_coef, share in cases:
            if model_dir != loaded:
                tokenizer = AutoTokenizer.from_pretrained(model_dir)
                pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
                model, ref_model = load_model(model_dir), load_model(model_dir, noise=0.05).eval()
                model.train()
                loaded = model_dir
            args = TrainArgs(loss=loss_type, kl_coef=kl_coef, clip_eps=CLIP, num_iterations=1)
            docs, _ = encode_rl_rows(tokenizer, parse_rl_rows(rows(tokenizer)), args.reward_scaling, MAX_LEN)
            weights = token_weights(docs, loss_type)
            computed, computed_weights, skipped_rows, skipped_tokens = docs, weights, 0, 0
            if kl_coef == 0:  # as `rl_step.rl_batch` does then
                computed, computed_weights, skipped_rows, skipped_tokens = with_gradient(docs, weights)
            # Padding-free: the trainer's own micro-batches (two blocks each, so several) and loss function.
            micro = rl_micro_batches(computed, computed_weights, MAX_LEN, 2, pad_id, share=share)
            plain = [d.doc for d in computed]
            shared = shared_prompt_tokens(plain, prompt_units(plain, MAX_LEN)) if share else 0
            trainer = SimpleNamespace(args=args,
                                      par=SimpleNamespace(device=torch.device("cpu")), lora=False, ref_model=ref_model,
                                      ddp=model, routing=None)  # fmt: skip
            loss_fn = grpo_loss(trainer, RLBatch(micro, {}, 0))
            sums = torch.zeros(len(STATS), dtype=torch.float64)  # loss, clipped, tokens, KL sum, correction, routing
            head_rows = []
            hook = model.output_layer.register_forward_hook(lambda mod, inp, out: head_rows.append(inp[0].shape[0]))
            for i, m in enumerate(micro):
                loss, stats = loss_fn(i, m.batch, token_losses(model, m.batch, loss_only=True))
                loss.backward()
                sums += stats
            hook.remove()
            free_grads = grads(model)
            padded, padded_stats, padded_tokens = padded_loss(model, ref_model, docs, weights, pad_id, kl_coef)
            padded.backward()
            padded_grads = grads(model)
            rel = {n: float((free_grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in padded_grads.items()}
            worst = max(rel, key=rel.get)
            result[case] = {
                "loss_free": float(sums[0]), "loss_padded": float(padded.detach()),
                "clipped_tokens": float(sums[1]), "loss_tokens": float(sums[2]) + skipped_tokens,
                "kl_sum": float(sums[3]),
                "clipped_tokens_padded": float(padded_stats["clipped_tokens"]),
                "loss_tokens_padded": float(padded_stats["tokens"]), "rows_skipped": skipped_rows,
                "zero_advantage_docs": sum(d.advantage == 0.0 for d in docs),
                "grad_rel_max": rel[worst], "worst": worst,
                "grad_norm": float(torch.stack([g.norm() for g in padded_grads.values()]).norm()),
                "tokens_free": sum(int(m.batch.tokens.numel()) for m in micro), "tokens_padded": padded_tokens,
                "micro_batches": len(micro), "documents": len(docs),
                "doc_tokens": sum(len(d.doc.tokens) for d in computed), "shared_tokens": shared,
                "head_rows_free": sum(head_rows[: len(micro)]),  # the policy's forwards (the KL reference's follow)
                "lengths": sorted({len(d.doc.tokens) for d in docs}),
            }  # fmt: skip
        first_model = load_model(first)
        first_model.train()
        result.update(tinker_cases(first_model, AutoTokenizer.from_pretrained(first)))
        for d in sys.argv[2:]:  # and on mixture-of-experts models (no load-balancing loss trained: the default)
            if model_arch(Path(d)).num_experts:
                moe = load_model(Path(d))
                moe.train()
                result.update(tinker_cases(moe, AutoTokenizer.from_pretrained(d), suffix=f":{Path(d).name}"))
                balanced = load_model(Path(d), aux_loss_coef=0.01)
                balanced.train()
                result.update(tinker_balance_loss_cases(balanced, AutoTokenizer.from_pretrained(d), 0.01,
                                                        suffix=f":{Path(d).name}"))  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
