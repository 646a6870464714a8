"""Run by test_moe_parity.py as one plain process or under `mpirun -n 2` (TP=2 or EP=2): `moe_check.py TP EP MODEL...`.

For each mixture-of-experts HF model directory: builds the megatron model on this rank's TP shard and share of the
experts, loads the HF weights through the converter, runs one random batch through both megatron and transformers,
and prints one JSON line (rank 0) with, over every MoE layer and every rank (at EP=2 each rank runs its own batch,
so the dispatcher carries each rank's tokens to the other rank's experts and back),
* `router_logit_diff`: max |router logits (megatron's fp32 gating) - HF's `gate` logits|;
* `experts_equal`: megatron's routing map selects exactly the experts HF's top-k chose, token by token;
* `prob_diff`: max |megatron's routing probabilities - HF's top-k weights| (zero off the chosen experts);
* `layer_diff`: max |MoE block output| difference (megatron's `mlp` vs HF's sparse block); `layer_scale`: max |HF's|;
* `logit_diff`: max |whole-model logits| difference; `moe_layers`: how many layers were compared;
* `local_experts`: experts per rank; `read_fraction`: the most any rank read of the checkpoint's bytes;
* `length_syncs`: how often the forward pass asked the expert group for its longest micro-batch (EP > 1).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from moe_single import hf_sparse_block, hook_hf_router, load_into


def check(model_dir: Path, par) -> dict:
    from transformers import AutoModelForCausalLM

    from scalarlm.protocol.errors import InvalidRequest
    from scalarlm.training.families import expert_rank
    from scalarlm.training.model import build_gpt_model, check_tensor_parallel, model_arch

    arch = expert_rank(model_arch(model_dir), par.ep_rank, par.ep_size)
    try:
        check_tensor_parallel(arch, par.tp_size)
    except InvalidRequest as e:  # refused at this TP size, by name (at submission too)
        return {"model": model_dir.name, "tp": par.tp_size, "ep": par.ep_size, "refused": e.message}
    model = build_gpt_model(arch, par.tp_size, bf16=False, parallel_output=False)
    read = load_into(model, model_dir, arch, par)  # only this rank's experts
    model.eval()
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sparse = [i for i in range(arch.num_layers) if arch.is_moe(i)]

    ours: dict[int, dict] = {i: {} for i in sparse}
    theirs: dict[int, dict] = {i: {} for i in sparse}
    hooks = []
    for i in sparse:
        router = model.decoder.layers[i].mlp.router
        gating = router.gating

        def record_gating(x, i=i, gating=gating):
            ours[i]["logits"] = gating(x)
            return ours[i]["logits"]

        router.gating = record_gating
        hooks.append(router.register_forward_hook(lambda m, a, out, i=i: ours[i].update(probs=out[0], map=out[1])))
        hooks.append(model.decoder.layers[i].mlp.register_forward_hook(
            lambda m, a, out, i=i: ours[i].update(out=out[0].transpose(0, 1).clone())))  # fmt: skip
        # (cloned: megatron adds the residual into that tensor in place; [S, B] -> [B, S])
        hooks.append(hook_hf_router(ref.model.layers[i], theirs[i].update))
        hf_block = hf_sparse_block(ref.model.layers[i])
        hooks.append(hf_block.register_forward_hook(  # GPT-OSS's block returns (output, router scores)
            lambda m, a, out, i=i: theirs[i].update(out=out[0] if isinstance(out, tuple) else out)))  # fmt: skip

    gen = torch.Generator().manual_seed(par.dp_rank)  # TP ranks share a batch; EP (= DP) ranks each have their own
    ids = torch.randint(0, arch.vocab_size, (2, 24), generator=gen)
    causal = torch.ones(24, 24, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        our_logits = model(ids, torch.arange(24).expand(2, 24), causal)
        their_logits = ref(ids).logits
    for h in hooks:
        h.remove()

    router_diff = prob_diff = layer_diff = layer_scale = 0.0
    experts_equal = True
    tokens = ids.numel()
    for i in sparse:
        o, t = ours[i], theirs[i]
        # megatron's router sees [S, B, H] (tokens s-major), HF's [B * S, H] (b-major): reorder megatron's rows
        def b_major(x):
            return x.reshape(24, 2, -1).transpose(0, 1).reshape(tokens, -1)

        hf_map = torch.zeros(tokens, arch.num_experts, dtype=torch.bool).scatter(1, t["index"], True)
        hf_probs = torch.zeros(tokens, arch.num_experts).scatter(1, t["index"], t["weights"].float())
        router_diff = max(router_diff, (b_major(o["logits"]) - t["logits"]).abs().max().item())
        experts_equal = experts_equal and torch.equal(b_major(o["map"]), hf_map)
        prob_diff = max(prob_diff, (b_major(o["probs"]) - hf_probs).abs().max().item())
        # megatron's block output is scaled by Granite's residual multiplier (a hook on the block), HF's before the add
        layer_diff = max(layer_diff, (o["out"] - t["out"] * (arch.residual_multiplier or 1.0)).abs().max().item())
        layer_scale = max(layer_scale, t["out"].abs().max().item())
    mine = {"router_logit_diff": router_diff, "experts_equal": experts_equal, "prob_diff": prob_diff,
            "layer_diff": layer_diff, "layer_scale": layer_scale,
            "logit_diff": (our_logits - their_logits).abs().max().item(),
            "read_fraction": read["bytes_read"] / read["stored_bytes"],
            "length_syncs": getattr(model, "length_syncs", 0)}  # fmt: skip
    every: list = [None] * par.world_size
    torch.distributed.all_gather_object(every, mine)
    worst = {key: max(r[key] for r in every) for key in mine if key != "experts_equal"}
    return {"model": model_dir.name, "tp": par.tp_size, "ep": par.ep_size, "moe_layers": len(sparse),
            "local_experts": len(arch.local_experts), "experts_equal": all(r["experts_equal"] for r in every),
            **worst}  # fmt: skip


def main() -> int:
    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.parallel import init_parallel, shutdown_parallel

    tp, ep = int(sys.argv[1]), int(sys.argv[2])
    par = init_parallel(launch_env_from(os.environ), tp, seed=0, expert_parallel_size=ep)
    try:
        for model_dir in map(Path, sys.argv[3:]):
            result = check(model_dir, par)
            if par.is_main:
                print("RESULT " + json.dumps(result), flush=True)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
