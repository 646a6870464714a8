"""Run by test_moe_parity.py as one plain process: `moe_replay_check.py MODEL...`.

For each mixture-of-experts HF model directory, on one random batch [1, 48]: a first forward records every MoE
layer's chosen experts (`moe_replay.RoutingReplay`); then every router's weights are moved (as training moves them)
so that it would choose differently; then one forward without replay and one with it. Prints one JSON line:
* `changed_fraction`: (token, layer) pairs whose own top-k now differs from the recorded one, counted by the
  RoutingReplay on the pass without replay, and `changed_fraction_replayed` on the replayed pass (the same count);
* `replay_diff`: max |MoE layer output under replay - the same layer computed in float64 from its input, the moved
  router's logits and the *recorded* experts| (probabilities: softmax over the recorded experts' logits when HF
  renormalises the top k, else the full softmax taken at them, or their sigmoid scores renormalised and scaled; plus
  the shared expert, gated or not, where there is one; GPT-OSS's biases and clamped activation), over
  every MoE layer; `replay_scale`: the largest |reference output|;
* `replay_effect`: max |MoE layer output without replay - with replay| (how much the replay changes at all).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from moe_single import load_into, loaded_model, run_each

SEQ = 48


def reference(h: torch.Tensor, mlp, experts: torch.Tensor, arch) -> torch.Tensor:
    """One MoE layer in float64: [T, H] input, the recorded [T, k] experts."""
    h = h.double()

    def linear(layer, x: torch.Tensor) -> torch.Tensor:  # GPT-OSS's router and experts carry biases
        bias = getattr(layer, "bias", None)
        return x @ layer.weight.double().t() + (0.0 if bias is None else bias.double())

    logits = linear(mlp.router, h)
    if arch.moe_sigmoid:  # GLM-4.5: the recorded experts' sigmoid scores renormalised, times the scaling factor
        probs = torch.sigmoid(logits).gather(1, experts)
        probs = probs / probs.sum(dim=-1, keepdim=True) * (arch.moe_scaling or 1.0)
    elif arch.moe_norm_topk:
        probs = torch.softmax(logits.gather(1, experts), dim=-1)
    else:
        probs = torch.softmax(logits, dim=-1).gather(1, experts)
    def swiglu(mlp) -> torch.Tensor:
        gate, up = linear(mlp.linear_fc1, h).chunk(2, dim=-1)
        if arch.glu_clamp is not None:  # GPT-OSS: clamped, x sigmoid(1.702 x), and (up + 1)
            gate, up = gate.clamp(max=arch.glu_clamp), up.clamp(-arch.glu_clamp, arch.glu_clamp) + 1
            return linear(mlp.linear_fc2, gate * torch.sigmoid(1.702 * gate) * up)
        return linear(mlp.linear_fc2, F.silu(gate) * up)

    out = torch.zeros_like(h)
    for e, expert in enumerate(mlp.experts.local_experts):
        weight = (probs * (experts == e)).sum(dim=1, keepdim=True)
        out += weight * swiglu(expert)
    shared = getattr(mlp, "shared_experts", None)  # Qwen2-MoE's (gated), GLM-4.5's: beside the routed ones
    if shared is not None:
        gate = getattr(shared, "gate_weight", None)
        out += (1.0 if gate is None else torch.sigmoid(h @ gate.double().t())) * swiglu(shared)
    return out * (arch.residual_multiplier or 1.0)  # Granite scales the block's output (a hook on megatron's block)


def check(model_dir: Path) -> dict:
    from scalarlm.training.model import model_arch
    from scalarlm.training.moe_replay import RoutingReplay

    arch = model_arch(model_dir)
    assert arch.activation == "silu" or arch.glu_clamp is not None, arch.activation
    model = loaded_model(model_dir, arch)
    replay = RoutingReplay(model, replay=True)
    moe = [layer.mlp for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for j, mlp in enumerate(moe):
        mlp.register_forward_hook(lambda m, args, out, j=j: seen.__setitem__(j, (args[0][:, 0].clone(), out[0][:, 0].clone())))

    ids = torch.randint(0, arch.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(SEQ)[None]
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]

    def forward() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        seen.clear()
        with replay.forward_pass(0):
            model(ids, positions, causal)
        replay.done()
        return dict(seen)

    with torch.no_grad():
        forward()  # the batch's first pass: records
        recorded = replay.recorded[0]
        gen = torch.Generator().manual_seed(6)
        for mlp in moe:  # the router moves
            w = mlp.router.weight
            w.add_(torch.randn(w.shape, generator=gen) * w.std() * 2.0)
        replay.replay = False
        natural = forward()
        changed, compared = replay.take_counts().tolist()
        replay.replay = True
        replayed = forward()
        changed_replayed, compared_replayed = replay.take_counts().tolist()
    references = [reference(replayed[j][0], mlp, recorded[j], arch) for j, mlp in enumerate(moe)]
    replay_diff = max((ref - replayed[j][1].double()).abs().max().item() for j, ref in enumerate(references))
    scale = max(ref.abs().max().item() for ref in references)
    effect = max((natural[j][1] - replayed[j][1]).abs().max().item() for j in range(len(moe)))
    return {"model": model_dir.name, "layers": len(moe), "compared": compared, "changed_fraction": changed / compared,
            "changed_fraction_replayed": changed_replayed / compared_replayed, "replay_diff": replay_diff,
            "replay_scale": scale, "replay_effect": effect,
            "bf16_bias_exact": bf16_bias_exact(model_dir, arch)}  # fmt: skip


def bf16_bias_exact(model_dir: Path, arch) -> bool | None:
    """A sigmoid router's fixed expert bias in the bf16 model (`model.half_precision`, megatron's Float16Module casts
    every weight): still fp32 and equal to the checkpoint's. None without one."""
    if not arch.moe_sigmoid:
        return None
    from safetensors.torch import load_file

    from scalarlm.training.model import build_gpt_model, half_precision

    model = build_gpt_model(arch, 1, bf16=True)
    load_into(model, model_dir, arch)
    half_precision(model)
    hf = load_file(str(model_dir / "model.safetensors"))
    biases = [(p, hf[f"model.layers.{int(n.split('.')[2])}.mlp.gate.e_score_correction_bias"])
              for n, p in model.named_parameters() if n.endswith("router.expert_bias")]  # fmt: skip
    assert biases and any(p.dtype == torch.bfloat16 for p in model.parameters())
    return all(p.dtype == torch.float32 and torch.equal(p.detach(), want) for p, want in biases)


if __name__ == "__main__":
    sys.exit(run_each(check))
