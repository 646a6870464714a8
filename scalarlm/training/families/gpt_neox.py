"""GPT-NeoX (`GPTNeoXForCausalLM`: EleutherAI's Pythia suite, 14M-12B and its -deduped models, GPT-NeoX-20B, and
the checkpoints fine-tuned from them, e.g. TRL's TL;DR SFT/RLHF baselines): multi-head attention through one fused
`attention.query_key_value` whose rows hold each head's [q; k; v] in turn (megatron's own `linear_qkv` layout, so it
is split over TP by rows, not regrouped), RoPE on the leading `rotary_pct` of each head's dims (0.25 when absent, as
transformers assumes; base `rotary_emb_base`), LayerNorms with biases, biases on every projection, an ungated GeLU MLP
(`dense_h_to_4h`, `dense_4h_to_h`), untied `embed_out`, all under `gpt_neox.` names of its own. With
`use_parallel_residual` (the released models') attention and the MLP read the layer's input through their own norms,
`x + attn(ln1(x)) + mlp(ln2(x))`; without, the layer is the sequential pre-norm one. `hidden_dropout` applies to the
embeddings and to each block's output, `attention_dropout` to the attention probabilities, as transformers trains it.
LoRA targets PEFT's names for its modules: `query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h`.
Refused: `attention_bias` false (megatron's one `add_bias_linear` would drop the MLP's biases too).
"""

from __future__ import annotations

from typing import Any

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.spec import Family


def _read_config(config: dict[str, Any]) -> dict[str, Any]:
    """The 4.x hub spelling, as transformers 5 reads it: `rotary_pct` is `partial_rotary_factor`, `rotary_emb_base`
    is `rope_theta` (10000 when absent); `attention_bias` is true when absent (the released configs omit it)."""
    renamed = {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"}
    config = {**config, **{new: config[old] for old, new in renamed.items() if old in config and new not in config}}
    defaults = {"rope_theta": 10000.0, "attention_bias": True}
    return {**config, **{k: v for k, v in defaults.items() if config.get(k) is None}}


def _refuse(config: dict[str, Any]) -> None:
    if config.get("attention_bias") is False:
        raise InvalidRequest("attention_bias=false is not supported for gpt_neox (its MLP keeps its biases, which the "
                             "trainer adds with the attention output's)", param="model")  # fmt: skip


def _extra(config: dict[str, Any]) -> dict[str, Any]:
    dropout = float(config.get("hidden_dropout") or 0.0)
    return {"layer_norm": True, "linear_bias": True, "norm_eps": float(config.get("layer_norm_eps") or 1e-5),
            "hidden_dropout": dropout, "embedding_dropout": dropout,
            "parallel_block": bool(config.get("use_parallel_residual", True)), "parallel_mlp_norm": True}  # fmt: skip


GPT_NEOX = Family(
    name="gpt_neox",
    architectures=("GPTNeoXForCausalLM",),
    partial_rotary=0.25,
    read_config=_read_config,
    refuse=_refuse,
    fused_qkv=True,
    qkv_grouped=True,
    qkv_bias_from_weights=True,
    attention_names=("attention", "query_key_value", "dense"),
    model_names=("gpt_neox.embed_in", "gpt_neox.layers", "gpt_neox.final_layer_norm", "embed_out"),
    fused_gate_up=True,  # one MLP input projection: dense_h_to_4h
    mlp_names=("mlp", "dense_h_to_4h", "dense_4h_to_h"),
    gated_mlp=False,
    activations=frozenset({"gelu", "gelu_fast"}),  # gelu_fast: GPT-NeoX-20B's (the tanh approximation)
    extra=_extra,
    notes="Pythia / GPT-NeoX: parallel residual with two LayerNorms, fused per-head qkv, partial RoPE, biases",
)
