"""Run by test_lora.py: greedy tokens of vLLM (enable_lora, LoRARequest) and of PEFT on the HF base, as JSON.

argv: base model dir, adapter dir, prompts as a JSON list. Prints `RESULT {"vllm": [[ids]], "peft": [[ids]]}`.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    base, adapter, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    new_tokens = 8
    llm = LLM(
        model=base, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30, max_model_len=256,
        enable_lora=True, max_loras=2, max_lora_rank=8, seed=0,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    outs = llm.generate(prompts, params, lora_request=LoRARequest("job", 1, adapter))
    ours = [list(o.outputs[0].token_ids) for o in outs]

    tok = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    theirs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        theirs.append(out[0, ids.shape[1] :].tolist())
    print("RESULT " + json.dumps({"vllm": ours, "peft": theirs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
