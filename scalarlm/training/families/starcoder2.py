"""StarCoder2 (`Starcoder2ForCausalLM`: bigcode's starcoder2-3b, -7b, -15b and their instruct models): grouped-query
attention with RoPE and a sliding window on every layer, LayerNorm (with a bias, `norm_epsilon`) before attention and
the MLP and at the end, a plain MLP (`c_fc`, tanh GeLU, `c_proj`: no gate), biases on every projection (`use_bias`),
tied embeddings; dropout in training on the embeddings, the attention probabilities and both residual branches
(`embedding_dropout`, `attention_dropout`, `residual_dropout`), as transformers trains it. LoRA targets
`c_fc` and `c_proj` as PEFT names them (the default targets' up_proj and down_proj).
"""

from __future__ import annotations

from typing import Any

from scalarlm.training.families.spec import Family, every_layer_window


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "layer_norm": True,
        "linear_bias": bool(config.get("use_bias", True)),
        "norm_eps": float(config.get("norm_epsilon") or 1e-5),
        "hidden_dropout": float(config.get("residual_dropout") or 0.0),
        "embedding_dropout": float(config.get("embedding_dropout") or 0.0),
    }


STARCODER2 = Family(
    name="starcoder2",
    architectures=("Starcoder2ForCausalLM",),
    fused_gate_up=True,  # one MLP input projection: c_fc
    mlp_names=("mlp", "c_fc", "c_proj"),
    gated_mlp=False,
    qkv_bias_from_weights=True,
    windows=every_layer_window,
    activations=frozenset({"gelu_pytorch_tanh"}),
    extra=_extra,
    notes="StarCoder2: LayerNorm, an ungated GeLU MLP, biases everywhere, sliding window, dropout",
)
