"""EXAONE 4.0 (`Exaone4ForCausalLM`: LG AI Research's EXAONE-4.0-32B and 1.2B): Llama's attention and SwiGLU with
OLMo 2's norm placement (no norm before attention or the MLP; an RMSNorm on each block's output before the residual
add, HF's `post_attention_layernorm` and `post_feedforward_layernorm`), Qwen3's per-head q/k RMSNorms before RoPE,
and hybrid attention: `sliding_window` on the `layer_types` "sliding_attention" layers (3 of 4 in the 32B), the
full-attention layers without RoPE (NoPE) whenever any layer slides; RoPE optionally `llama3`-scaled (the 32B's).
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family, layer_type_windows, pattern_layer_types


def _types(config: dict[str, Any], layers: int) -> list[str]:
    """`layer_types`, derived as transformers' Exaone4Config does when absent (every `sliding_window_pattern`-th layer
    full); a window without sliding layers, or sliding layers without a window, is refused: transformers and vLLM
    then place RoPE on different layers."""
    types = config.get("layer_types")
    window = config.get("sliding_window")
    if types is None:
        if window is None:
            raise InvalidRequest("layer_types is missing and sliding_window is null (transformers cannot derive the "
                                 "layer types)", param="model")  # fmt: skip
        types = pattern_layer_types(config, layers, 4)
    sliding = "sliding_attention" in types
    if sliding != (window is not None):
        raise InvalidRequest(f"sliding_window={window} with {'some' if sliding else 'no'} sliding_attention layers is "
                             "not supported (transformers and vLLM would rotate different layers)",
                             param="model")  # fmt: skip
    return list(types)


def _rope_layers(config: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """RoPE on the sliding layers only when some layer slides (global NoPE), on every layer otherwise."""
    types = _types(config, layers)
    return tuple(t == "sliding_attention" or "sliding_attention" not in types for t in types)


EXAONE4 = Family(
    name="exaone4",
    architectures=("Exaone4ForCausalLM",),
    qk_layernorm=True,
    input_norms=False,
    sandwich_norms=True,
    rope_types=frozenset({"default", "llama3"}),
    rope_layers=_rope_layers,
    windows=lambda config, layers: layer_type_windows({**config, "layer_types": _types(config, layers)}, layers,
                                                      True),  # fmt: skip
    notes="EXAONE 4.0: output norms only, per-head q/k norms, sliding layers with RoPE and global NoPE layers",
)
