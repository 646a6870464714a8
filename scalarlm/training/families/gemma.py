"""Gemma 1/2/3 and other recognised families the trainer refuses, each with the reason.

Gemma needs modules megatron-core 0.16.1 lacks (zero-centred (1 + w) RMSNorm, embedding x sqrt(hidden), the
post-attention / post-MLP output norms, soft-capping, Gemma 3's second RoPE base for local layers). Until they are
written and proven by the parity tests, a Gemma job is refused at submission rather than trained wrongly.
"""

from __future__ import annotations

from scalarlm.training.families.spec import Refused

_GEMMA = (
    "Gemma needs zero-centred (1 + w) RMSNorm, embedding scaling by sqrt(hidden_size), post-attention and post-MLP "
    "norms, GeGLU (tanh) and (Gemma 2) logit soft-capping / (Gemma 3) a second RoPE base; the trainer does not "
    "implement them yet"
)

REFUSED = (
    Refused(("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), _GEMMA),
    Refused(("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "PhimoeForCausalLM"),
            "mixture-of-experts layers are not supported yet"),  # fmt: skip
    Refused(("Olmo2ForCausalLM",), "OLMo 2 uses post-norm and full-width q/k norms, not implemented"),
    Refused(("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"), "multi-latent attention is not supported yet"),
)
