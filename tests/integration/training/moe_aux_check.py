"""Run by test_moe_aux_loss.py as one plain process: `moe_aux_check.py MODEL...`.

For each mixture-of-experts HF model directory, on one random batch [1, 40] in training mode, prints one JSON line:
* `metric`: `moe_balance.BalanceMeter`'s load-balancing loss (the value a step's metrics report);
* `numpy`: the same loss computed in NumPy from transformers' own router logits (each sparse block's `gate`), per
  MoE layer `E * sum_i f_i P_i` and the mean over layers (a sigmoid router's scores normalised to sum 1);
* `grad_diff`: max |grad| difference between megatron's aux loss (`moe_aux_loss_coef` = COEF, weighted by
  `aux_loss_scale`) and autograd of the explicit objective `ce_sum / T + COEF * sum over layers of the loss`;
* `aux_grad`: max |grad| difference that the aux loss makes (how far it moves the router's gradient at all).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from moe_single import hook_hf_router, loaded_model, run_each

COEF = 0.05
SEQ = 40


def numpy_balance(router_logits: list[np.ndarray], topk: int, sigmoid: bool) -> float:
    losses = []
    for logits in router_logits:
        if sigmoid:  # megatron's aux-loss scores of a sigmoid router: normalised to sum 1
            scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
            scores = scores / scores.sum(axis=1, keepdims=True)
        else:
            z = logits - logits.max(axis=1, keepdims=True)
            scores = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        chosen = np.zeros_like(scores)
        np.put_along_axis(chosen, np.argsort(-scores, axis=1)[:, :topk], 1.0, axis=1)
        tokens, experts = scores.shape
        losses.append(experts * float((chosen.sum(0) / (tokens * topk) * scores.mean(0)).sum()))
    return float(np.mean(losses))


def check(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from scalarlm.training.model import model_arch
    from scalarlm.training.moe_balance import BalanceMeter, aux_loss_scale, load_balancing_loss

    arch = model_arch(model_dir)
    ids = torch.randint(0, arch.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, dims=1)
    positions = torch.arange(SEQ)[None]
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]

    # megatron's aux loss, weighted as the step driver weighs a step of SEQ tokens.
    with_aux = loaded_model(model_dir, arch, COEF)
    meter = BalanceMeter(with_aux)
    aux_loss_scale(SEQ)
    with meter.forward_pass():
        ce = with_aux(ids, positions, causal, labels=labels)
    (ce.sum() / SEQ).backward()
    metric_sum, tokens = meter.take().tolist()

    # The reference objective, written out: the same model without megatron's aux loss, plus the loss of each
    # router's logits (captured with their graph).
    plain = loaded_model(model_dir, arch)
    logits = []
    for layer in plain.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        gating = router.gating

        def record(x, gating=gating):
            logits.append(gating(x))
            return logits[-1]

        router.gating = record
    ce_plain = plain(ids, positions, causal, labels=labels)
    aux = sum(load_balancing_loss(x.reshape(-1, x.shape[-1]), arch.moe_topk, sigmoid=arch.moe_sigmoid) for x in logits)
    (ce_plain.sum() / SEQ + COEF * aux).backward()
    no_aux = loaded_model(model_dir, arch)
    (no_aux(ids, positions, causal, labels=labels).sum() / SEQ).backward()

    def grads(model):
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}  # (not a sigmoid router's bias)

    a, b, c = grads(with_aux), grads(plain), grads(no_aux)
    grad_diff = max((a[n] - b[n]).abs().max().item() for n in a)
    aux_grad = max((a[n] - c[n]).abs().max().item() for n in a)

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sparse = [i for i in range(arch.num_layers) if arch.is_moe(i)]
    hf_logits: list[np.ndarray] = []  # each sparse block's router logits
    hooks = [hook_hf_router(ref.model.layers[i], lambda out: hf_logits.append(out["logits"].float().numpy()))
             for i in sparse]  # fmt: skip
    with torch.no_grad():
        ref(ids)
    for hook in hooks:
        hook.remove()
    assert len(hf_logits) == len(sparse), (len(hf_logits), sparse)
    return {"model": model_dir.name, "metric": metric_sum / tokens, "tokens": tokens, "grad_diff": grad_diff,
            "numpy": numpy_balance(hf_logits, arch.moe_topk, arch.moe_sigmoid), "aux_grad": aux_grad}  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_each(check))
