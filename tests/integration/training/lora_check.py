"""Run by test_lora.py and test_family_parity.py as one plain process (TP=1) or under `mpirun -n 2` (TP=2):
`lora_check.py TP OUT_ROOT MODEL_DIR...`.

For each HF model directory: builds the megatron model on this rank's TP shard, attaches LoRA on every module
the family targets (its defaults) with random (non-zero) A and B, exports the adapter in PEFT format to
OUT_ROOT/<model name> and prints one JSON line (rank 0): `max_diff` = max |logits(megatron + LoRA) - logits(HF base + PEFT adapter)|, and
`base_diff` (adapters disabled vs the plain HF base), and `grad_norms` of every adapter tensor for a fixed
objective after the trainer's TP all-reduce (TP=2 must equal TP=1).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def check(model_dir: Path, out: Path, par) -> dict:
    import torch.distributed as dist
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from scalarlm.protocol.training import LoraConfig
    from scalarlm.training import hf_io, lora
    from scalarlm.training.convert import hf_to_mcore, mark_tensor_parallel
    from scalarlm.training.model import build_gpt_model, check_tensor_parallel, model_arch, sequence_parallel

    from scalarlm.protocol.errors import InvalidRequest

    arch = model_arch(model_dir)
    try:  # refused by name (at submission too): LoRA on the family (DeepSeek's latent attention), or this TP size
        check_tensor_parallel(arch, par.tp_size)
        lora.check_targets(LoraConfig(r=4, alpha=8), arch)
    except InvalidRequest as e:
        return {"model": model_dir.name, "tp": par.tp_size, "refused": e.message}
    # as the trainer builds it: a mixture-of-experts model at TP > 1 under sequence parallelism
    model = build_gpt_model(arch, par.tp_size, bf16=False, parallel_output=False,
                            sequence_parallel=sequence_parallel(arch, par.tp_size))  # fmt: skip
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in hf_to_mcore(hf_io.load_weights(model_dir), arch, par.tp_rank, par.tp_size).items():
            params[name].copy_(value)
    mark_tensor_parallel(model, arch)
    config = LoraConfig(r=4, alpha=8)
    lora.attach_lora(model, arch, config, par.tp_rank, par.tp_size, seed=0)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for s in lora.lora_sets(model):
            for pair in s.pairs.values():
                pair.B.copy_(torch.randn(pair.B.shape, generator=gen) * 0.05)
    model.eval()
    ids = torch.randint(0, arch.vocab_size, (2, 20), generator=gen)
    causal = torch.ones(20, 20, dtype=torch.bool).triu(1)[None, None]
    pos = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        ours = model(ids, pos, causal)
        with lora.adapters_disabled(model):
            ours_base = model(ids, pos, causal)
    # Gradients of the adapters for a fixed objective, summed over TP as the trainer does before its step.
    target = torch.randn(ours.shape, generator=torch.Generator().manual_seed(3))
    (model(ids, pos, causal) * target).sum().backward()
    lora.allreduce_lora_grads(model, par.tp_group, par.tp_size)
    grads = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.requires_grad}
    if not par.is_main:
        dist.barrier()
        return {}
    lora.write_adapter(out, lora.peft_state(model, arch), lora.peft_config(config, arch, str(model_dir)))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        plain = base(ids).logits
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        theirs = peft_model(ids).logits
    dist.barrier()
    return {
        "model": model_dir.name,
        "target_modules": lora.check_targets(config, arch),
        "tp": par.tp_size,
        "max_diff": (ours - theirs).abs().max().item(),
        "base_diff": (ours_base - plain).abs().max().item(),
        "lora_effect": (theirs - plain).abs().max().item(),
        "logit_scale": theirs.abs().max().item(),
        "grad_norms": grads,
    }


def main() -> int:
    from scalarlm.training.launch_env import launch_env_from
    from scalarlm.training.parallel import init_parallel, shutdown_parallel

    tp = int(sys.argv[1])
    par = init_parallel(launch_env_from(os.environ), tp, seed=0)
    try:
        for model_dir in map(Path, sys.argv[3:]):
            out = Path(sys.argv[2]) / model_dir.name
            out.mkdir(parents=True, exist_ok=True)
            result = check(model_dir, out, par)
            if par.is_main:
                print("RESULT " + json.dumps(result), flush=True)
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
