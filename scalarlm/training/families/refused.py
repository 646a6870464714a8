"""Recognised architectures the trainer does not train yet, each with what it lacks and what is trained instead (the
model-specific refusals live beside their families: gemma.py, granite.py)."""

from __future__ import annotations

from scalarlm.training.families.spec import Refused

REFUSED = (
    Refused(("Mistral3ForConditionalGeneration",),
            "multimodal Mistral 3 (Mistral Small 3.1/3.2, Magistral Small 1.2, Ministral 3): its text model is not "
            "trained yet (MistralForCausalLM checkpoints and Gemma 3's multimodal ones are)"),
    Refused(("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
             "Qwen3VLMoeForConditionalGeneration"),
            "Qwen vision-language checkpoints are not trained yet (the Qwen2, Qwen2.5 and Qwen3 text models are)"),
    Refused(("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
             "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
            "gated DeltaNet (linear attention) layers are not supported (Qwen3-Next, Qwen3.5); Qwen3 and Qwen3-MoE "
            "are"),
    Refused(("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
            "Gemma 4 is not supported yet (Gemma 1, 2 and 3, text and 4B-27B multimodal, are)"),
)  # fmt: skip
