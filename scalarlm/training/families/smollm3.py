"""SmolLM3: Llama's shape with RoPE skipped on some layers (`no_rope_layers`, HF's 1 = this layer uses RoPE).

megatron-core's `no_rope_freq` uses the opposite convention (1 = skip RoPE); `model.py` converts.
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family, layer_type_windows


def rope_layers(config: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers apply RoPE, as transformers derives it (every `no_rope_layer_interval`-th layer does not)."""
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = int(config.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise InvalidRequest(f"no_rope_layers has {len(flags)} entries for {layers} layers", param="model")
    return tuple(bool(f) for f in flags)


SMOLLM3 = Family(
    name="smollm3",
    architectures=("SmolLM3ForCausalLM",),
    rope_layers=rope_layers,
    windows=lambda config, layers: layer_type_windows(config, layers, bool(config.get("use_sliding_window"))),
    notes="NoPE layers (no_rope_layers)",
)
