"""Qwen3 dense: Llama's shape plus a per-head RMSNorm on q and k before RoPE (`q_norm` / `k_norm`)."""

from __future__ import annotations

from scalarlm.training.families.spec import Family, layer_type_windows

QWEN3 = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    qk_layernorm=True,
    rope_types=frozenset({"default", "yarn"}),
    windows=lambda config, layers: layer_type_windows(config, layers, bool(config.get("use_sliding_window"))),
    notes="per-head q/k RMSNorm (qk_layernorm); yarn RoPE scaling (the long-context setting)",
)
