"""Published checkpoints for hot-swap tests, made with plain transformers/PEFT (no trainer), and HF greedy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _manifest(out: Path, name: str, step: int, kind: str, base: Path) -> None:
    (out / "manifest.json").write_text(
        json.dumps({"job_id": name, "step": step, "base_model": str(base), "kind": kind, "created": 1.0})
    )


def write_full_checkpoint(base: Path, out: Path, seed: int, step: int = 1) -> Path:
    """The base model with every weight perturbed (seeded), saved as an HF dir with a manifest."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    _manifest(out, out.name, step, "full", base)
    return out


def write_lora_checkpoint(base: Path, out: Path, seed: int, step: int = 1) -> Path:
    """A PEFT adapter (r=8 on every projection) with seeded non-zero B, saved with a manifest."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    peft.save_pretrained(out)
    _manifest(out, out.name, step, "lora", base)
    return out


def transformers_greedy(base: Path, prompts: list[str], tokens: int, full: Path | None = None,
                        lora: Path | None = None) -> list[list[int]]:
    """Greedy token ids from transformers for the base model, a full checkpoint, or base + a PEFT adapter."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model: Any = AutoModelForCausalLM.from_pretrained(full or base, dtype=torch.float32)
    if lora is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, lora)
    model.eval()
    results = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        results.append(argmax_tokens(model, ids, tokens))
    return results


def argmax_tokens(model: Any, ids: Any, tokens: int) -> list[int]:
    """`tokens` greedy steps that never stop at EOS, as vLLM's `ignore_eos` (HF's `min_new_tokens` would instead
    forbid EOS and pick the runner-up)."""
    import torch

    out: list[int] = []
    with torch.no_grad():
        for _ in range(tokens):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out
