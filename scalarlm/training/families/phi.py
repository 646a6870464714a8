"""Phi (`PhiForCausalLM`: Microsoft's phi-1, phi-1.5, phi-2): attention and the MLP side by side on one LayerNorm (with
its bias), `x + attn(ln(x)) + mlp(ln(x))` (Cohere's parallel block); q/k/v with biases and an output projection
`dense` with one; RoPE on the leading `partial_rotary_factor` of each head (phi-2: 0.4 of 80 dims; 0.5 when absent,
as transformers assumes); an ungated tanh-GeLU MLP (`fc1`, `fc2`, with biases); the final norm
`model.final_layernorm`; an untied output layer with a bias (`lm_head.bias`: `ModelArch.output_bias`). `resid_pdrop`
applies to attention's and the MLP's outputs and `embd_pdrop` to the embeddings, as transformers trains them. LoRA
targets PEFT's names: q/k/v_proj, `dense`, `fc1`, `fc2`. Refused: `qk_layernorm` (no released checkpoint sets it).
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family


def _read_config(config: dict[str, Any]) -> dict[str, Any]:
    """transformers' Phi always has biases on q/k/v and `dense` (its config has no `attention_bias`)."""
    return {**config, "attention_bias": True}


def _refuse(config: dict[str, Any]) -> None:
    if config.get("qk_layernorm"):
        raise InvalidRequest("qk_layernorm=true (LayerNorms on q and k) is not supported for phi", param="model")


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    return {"layer_norm": True, "linear_bias": True, "output_bias": True,
            "norm_eps": float(config.get("layer_norm_eps") or 1e-5),
            "hidden_dropout": float(config.get("resid_pdrop") or 0.0),
            "embedding_dropout": float(config.get("embd_pdrop") or 0.0)}  # fmt: skip


PHI = Family(
    name="phi",
    architectures=("PhiForCausalLM",),
    partial_rotary=0.5,
    parallel_block=True,
    qkv_bias_from_weights=True,
    attention_names=("self_attn", "qkv_proj", "dense"),
    model_names=("model.embed_tokens", "model.layers", "model.final_layernorm", "lm_head"),
    fused_gate_up=True,  # one MLP input projection: fc1
    mlp_names=("mlp", "fc1", "fc2"),
    gated_mlp=False,
    activations=frozenset({"gelu_new"}),
    read_config=_read_config,
    refuse=_refuse,
    extra=_extra,
    notes="phi-1.5 / phi-2: parallel attention and MLP on one LayerNorm, partial RoPE, biases, lm_head bias",
)
