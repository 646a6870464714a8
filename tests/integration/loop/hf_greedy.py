"""`transformers` greedy completions of a checkpoint, with each chosen token's logprob: the reference the family
serving tests compare vLLM with (imported by test_family_serving.py and family_engine_check.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROMPTS = ["What is the capital of France?", "What do bees make?", "What colour is the sky?"]
TOKENS = 6


def hf_greedy(base: Path, checkpoint: Path) -> tuple[list[str], list[list[float]]]:
    """`transformers` greedy completions of PROMPTS on `checkpoint` (PEFT over `base` for an adapter), and each chosen
    token's logprob."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lora = (checkpoint / "adapter_config.json").exists()
    # Eager attention: HF's SDPA path drops Gemma 2's attention soft cap (vLLM applies it).
    model: Any = AutoModelForCausalLM.from_pretrained(base if lora else checkpoint, dtype=torch.float32,
                                                      attn_implementation="eager")  # fmt: skip
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, checkpoint)
    model.eval()
    for module in model.modules():  # vLLM 0.32.0 holds xIELU's scalars (Apertus's) in bf16 whatever the model's dtype,
        if type(module).__name__ == "XIELUActivation":  # and computes their softplus there
            module.to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    answers, logprobs = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
        chosen = out.sequences[0, ids.shape[1] :]
        answers.append(tokenizer.decode(chosen, skip_special_tokens=True))
        steps = torch.log_softmax(torch.cat(out.logits).double(), -1)
        logprobs.append(steps.gather(1, chosen[:, None])[:, 0].tolist())
    return answers, logprobs
