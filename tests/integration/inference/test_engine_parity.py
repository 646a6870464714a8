"""The engine built from Settings generates exactly what transformers generates greedily."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = ["Hello, how are you", "The capital of France is", "12 + 7 ="]


def _transformers_greedy(model_dir: Any, prompts: list[str], tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    results = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        results.append(out[0, ids.shape[1]:].tolist())
    return results


async def test_greedy_tokens_match_transformers(vllm_engine: Any, tiny_model_dir: Any) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = _transformers_greedy(tiny_model_dir, PROMPTS, 8)
    for i, prompt in enumerate(PROMPTS):
        final = None
        async for out in vllm_engine.llm.generate({"prompt": prompt}, params, request_id=f"parity-{i}"):
            final = out
        assert final is not None
        assert list(final.outputs[0].token_ids) == expected[i], prompt
