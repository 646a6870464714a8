"""Llama (1-3.3, SmolLM2), Mistral and Qwen2/2.5: RMSNorm, SwiGLU, RoPE, grouped-query attention.

Llama 3.1-3.3 use `llama3` RoPE scaling (inverse frequencies computed from the config as transformers does); Llama and
Qwen2 also read `yarn` scaling (Qwen2.5's long-context setting);
Mistral applies `sliding_window` on every layer, Qwen2 on the `layer_types` layers when `use_sliding_window`;
Qwen2 carries q/k/v biases (read from the tensor names).
"""

from __future__ import annotations

from scalarlm.training.families.spec import Family, every_layer_window, layer_type_windows

LLAMA = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    rope_types=frozenset({"default", "llama3", "yarn"}),
    notes="Llama 1-3.3, SmolLM2; llama3 and yarn RoPE scaling",
)

MISTRAL = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    windows=every_layer_window,
    notes="sliding_window on every layer",
)

QWEN2 = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    qkv_bias_from_weights=True,
    rope_types=frozenset({"default", "yarn"}),
    windows=lambda config, layers: layer_type_windows(config, layers, bool(config.get("use_sliding_window"))),
    notes="Qwen2 / Qwen2.5; q/k/v biases",
)
