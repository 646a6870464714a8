"""Build a tiny random-weight model of any supported family with a locally trained tokenizer.

Tests, the demo and benchmarks need a real Hugging Face checkpoint that transformers, vLLM, PEFT and
the megatron converter all load, without downloading anything. This writes one in a few seconds:
random weights (std 0.08, so greedy outputs vary between prompts), float32 safetensors, and a byte-level
BPE tokenizer trained on a small built-in corpus, with a chat template. Same seed -> same files.

Each family is built offline from its transformers config class with the fields that family's real
checkpoints set (Qwen3's q/k norms, Llama 3.2's `llama3` RoPE, SmolLM3's NoPE layers, Phi-3's fused
projections, Mistral's sliding window), scaled down; head size stays 64 for vLLM's CPU attention.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

# `--family` names: the trainer's families (scalarlm.training.families) plus llama3 (Llama with llama3 RoPE).
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma", "gemma2", "gemma3", "olmo2",
            "olmo3", "qwen3_moe", "qwen2_moe", "mixtral", "granite", "glm", "glm4", "glm4_moe", "deepseek_v3",
            "deepseek_v2", "olmoe", "exaone4", "ernie4_5", "granite4", "granitemoe", "gpt_oss",
            "seed_oss", "starcoder2", "arcee", "nemotron", "apertus", "hunyuan", "cohere", "cohere2",
            "gpt_neox", "phi", "stablelm", "gemma3_mm")  # fmt: skip
Family = Literal["llama", "llama3", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma", "gemma2", "gemma3",
                 "olmo2", "olmo3", "qwen3_moe", "qwen2_moe", "mixtral", "granite", "glm", "glm4", "glm4_moe",
                 "deepseek_v3", "deepseek_v2", "olmoe", "exaone4", "ernie4_5", "granite4", "granitemoe",
                 "gpt_oss", "seed_oss", "starcoder2", "arcee", "nemotron", "apertus", "hunyuan", "cohere",
                 "cohere2", "gpt_neox", "phi", "stablelm", "gemma3_mm"]  # fmt: skip
# Mixture-of-experts tiny models: 4 experts, 2 per token, each expert's intermediate size hidden / 2.
TINY_EXPERTS, TINY_TOPK = 4, 2
# Families whose real checkpoints tie the output layer to the embedding (Qwen3 0.6B-4B, Llama 3.2, SmolLM3, Gemma).
TIED_BY_DEFAULT = frozenset({"qwen3", "llama3", "smollm3", "gemma", "gemma2", "gemma3", "granite", "ernie4_5",
                             "granite4", "granitemoe", "starcoder2", "hunyuan", "cohere", "cohere2",
                             "gemma3_mm"})  # fmt: skip
# Multimodal Gemma 3's image tokens (its tokenizer's `boi_token`, `eoi_token`, `image_token`), added to the tiny
# tokenizer; its image side shrunk: a 56-pixel image in 14-pixel patches, pooled to 4 tokens.
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}  # fmt: skip
GEMMA3_IMAGE = {"image_size": 56, "patch_size": 14, "mm_tokens_per_image": 4}

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]
# vLLM's CPU attention kernels support only these head sizes.
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 192, 256)
INIT_STD = 0.08

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A model learns from data and answers questions.
What is the capital of France? The capital of France is Paris. What is two plus two? It is four.
Hello, how are you today? I am fine, thank you. Please write a short story about a cat.
Once upon a time there was a little cat who lived in a house by the sea with her friends.
The weather is nice and the sun is shining. We train and serve language models on one cluster.
Generate, score, train, publish the weights, and generate again with the new weights.
The user asks a question and the assistant gives a helpful, honest and short answer.
Numbers: zero one two three four five six seven eight nine ten eleven twelve hundred thousand.
Count the apples, add the oranges, subtract the pears and multiply by the number of baskets.
system user assistant question answer reward score step loss learning rate batch prompt token.
"""


def _corpus() -> list[str]:
    """A small deterministic English + digits + arithmetic corpus for tokenizer training."""
    lines = [line for line in _ENGLISH.splitlines() if line]
    for a in range(0, 40):
        for b in range(0, 40, 3):
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a} * {b} = {a * b}")
            if a >= b:
                lines.append(f"What is {a} - {b}? {a - b}")
    lines.extend(str(n) for n in range(0, 1000, 7))
    return lines * 2


def _build_tokenizer(vocab: int):
    """Train a byte-level BPE tokenizer of exactly `vocab` entries and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab must be at least {len(alphabet) + len(SPECIAL_TOKENS)} for a byte-level BPE")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"tokenizer corpus too small for vocab={vocab} (got {tok.get_vocab_size()})")
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=1024,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _family_config(
    family: Family,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    max_position: int,
    tie_embeddings: bool,
    token_ids: dict[str, int],
):
    """The transformers config for the requested family (its real fields, tiny sizes)."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        initializer_range=INIT_STD,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        **token_ids,
    )
    head_dim = hidden // heads
    if family == "llama":
        return transformers.LlamaConfig(head_dim=head_dim, attention_bias=False, mlp_bias=False, **common)
    if family == "llama3":
        # Llama 3.2's RoPE with its original context scaled down, so positions past it (where the scaling changes
        # the angles of the low frequencies) fit a CPU test, and factors megatron does not hard-code.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": max(64, max_position // 8)}  # fmt: skip
        return transformers.LlamaConfig(head_dim=head_dim, attention_bias=False, mlp_bias=False, rope_parameters=rope,
                                        **common)  # fmt: skip
    if family == "mistral":
        return transformers.MistralConfig(head_dim=head_dim, sliding_window=8, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim, attention_bias=False, use_sliding_window=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                        **common)  # fmt: skip
    if family == "smollm3":
        # Every `no_rope_layer_interval`-th layer skips RoPE (interval 4 in SmolLM3-3B; 2 here so 2 layers show it).
        return transformers.SmolLM3Config(no_rope_layer_interval=2, use_sliding_window=False, attention_bias=False,
                                          mlp_bias=False, **common)  # fmt: skip
    if family == "phi3":
        return transformers.Phi3Config(resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=max_position,
                                       **common)  # fmt: skip
    if family == "gemma":
        # Gemma 1's fields (2B: multi-query attention, head_dim 256; 7B: multi-head): hub configs say the tanh GeLU as
        # `hidden_activation` (vLLM and the trainer read it first); transformers 5 reads `hidden_act`, so both say it.
        return transformers.GemmaConfig(head_dim=head_dim, attention_bias=False, hidden_act="gelu_pytorch_tanh",
                                        hidden_activation="gelu_pytorch_tanh",
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                        **common)  # fmt: skip
    if family == "gemma2":
        # Gemma 2's alternating sliding/global layers and soft caps; caps small enough that tanh bends the tiny
        # model's scores and logits (Gemma 2 9B: 50 and 30), so a missing cap would show in the parity tests.
        return transformers.Gemma2Config(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=8,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                         attention_bias=False, hidden_activation="gelu_pytorch_tanh",
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                         **common)  # fmt: skip
    if family == "gemma3":
        # Gemma 3's 5:1 sliding:global pattern shrunk to 1:1, with its two RoPE bases and attention scalar.
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
        return transformers.Gemma3TextConfig(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=8,
                                             layer_types=types, rope_parameters=rope, attention_bias=False,
                                             hidden_activation="gelu_pytorch_tanh", **common)  # fmt: skip
    if family == "glm":
        # glm-4-9b-chat-hf's fields: GLM-4-0414's without its output norms.
        return transformers.GlmConfig(head_dim=head_dim, attention_bias=True, partial_rotary_factor=0.5, **common)
    if family == "glm4_moe":
        # GLM-4.5's fields (a dense first layer, q/k norms, sigmoid routing scaled by routed_scaling_factor, one shared
        # expert),
        # with DeepSeek-V3's group-limited routing (2 groups of 2 experts, the best group kept) so it is exercised.
        return transformers.Glm4MoeConfig(head_dim=head_dim, attention_bias=True, partial_rotary_factor=0.5,
                                          n_routed_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOPK,
                                          moe_intermediate_size=hidden // 2, n_shared_experts=1,
                                          first_k_dense_replace=1, n_group=2, topk_group=1,
                                          routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                                          **common)  # fmt: skip
    if family == "deepseek_v3":
        # DeepSeek-V3's fields shrunk: multi-latent attention (a q latent, rope dims apart from the rest; the kv
        # latent and rope dims at V3's 512 + 64, the only size vLLM's CPU MLA decode kernel runs), yarn with both
        # mscale terms (V3: factor 40 over 4K), a dense first layer, sigmoid group-limited routing (`scoring_func` and
        # `topk_method` as the hub's configs say: vLLM reads them, transformers 5 does not write them) and a shared
        # expert.
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 128,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}  # fmt: skip
        return transformers.DeepseekV3Config(q_lora_rank=hidden // 4, kv_lora_rank=512, qk_nope_head_dim=32,
                                             qk_rope_head_dim=64, v_head_dim=32, rope_interleave=True,
                                             scoring_func="sigmoid", topk_method="noaux_tc",
                                             n_routed_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOPK,
                                             moe_intermediate_size=hidden // 2, n_shared_experts=1,
                                             first_k_dense_replace=1, n_group=2, topk_group=1,
                                             routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=yarn,
                                             attention_bias=False, **common)  # fmt: skip
    if family == "deepseek_v2":
        # DeepSeek-V2-Lite's fields shrunk: multi-latent attention without a q latent (one q_proj), the kv latent and
        # rope dims at 512 + 64, yarn with mscale = mscale_all_dim (V2-Lite: 0.707, factor 40 over 4K: no factor on
        # the rotated dims, the softmax scaled), a dense first layer, two shared experts, softmax routing: the top k
        # of every expert's probability (`greedy`, one group), not renormalised.
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 128,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
        return transformers.DeepseekV2Config(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
                                             qk_rope_head_dim=64, v_head_dim=32, scoring_func="softmax",
                                             topk_method="greedy", n_group=1, topk_group=1,
                                             n_routed_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOPK,
                                             moe_intermediate_size=hidden // 2, n_shared_experts=2,
                                             first_k_dense_replace=1, routed_scaling_factor=1.0,
                                             norm_topk_prob=False, moe_layer_freq=1, rope_parameters=yarn,
                                             attention_bias=False, **common)  # fmt: skip
    if family == "glm4":
        # GLM-4-0414's fields: RoPE on half of each head, adjacent pairs rotated; q/k/v biases; output norms.
        return transformers.Glm4Config(head_dim=head_dim, attention_bias=True, partial_rotary_factor=0.5,
                                       **common)  # fmt: skip
    if family == "ernie4_5":
        # ERNIE-4.5-0.3B's fields: GQA, RoPE on adjacent pairs, no biases, tied embeddings.
        return transformers.Ernie4_5Config(head_dim=head_dim, use_bias=False,
                                           rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                           **common)  # fmt: skip
    if family == "starcoder2":
        # starcoder2-3b's fields (GQA, biases everywhere, LayerNorm, tanh GeLU, tied embeddings; its 0.1 dropouts) with
        # a sliding window of 8 so the parity sequences pass it.
        fields = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        return transformers.Starcoder2Config(use_bias=True, norm_epsilon=1e-5, hidden_act="gelu_pytorch_tanh",
                                             sliding_window=8, attention_dropout=0.1, residual_dropout=0.1,
                                             embedding_dropout=0.1, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 100000.0},
                                             **fields)  # fmt: skip
    if family == "arcee":
        # AFM-4.5B's fields: GQA, an ungated ReLU-squared MLP (up_proj, down_proj), no biases, untied embeddings, yarn
        # RoPE (its factor 20) with the original context scaled down as the other yarn tiny models'.
        yarn = {**YARN_ROPE, "rope_theta": 10000.0, "factor": 20.0}
        return transformers.ArceeConfig(head_dim=head_dim, hidden_act="relu2", attention_bias=False, mlp_bias=False,
                                        rope_parameters=yarn, **common)  # fmt: skip
    if family == "hunyuan":
        # Hunyuan-7B-Instruct's fields: GQA, per-head q/k norms after RoPE, `dynamic` RoPE with its NTK alpha 1000,
        # tied embeddings.
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0, "alpha": 1000.0}
        return transformers.HunYuanDenseV1Config(head_dim=head_dim, attention_bias=False, rope_parameters=rope,
                                                 **common)  # fmt: skip
    if family == "apertus":
        # Apertus-8B's fields: GQA, q/k norms, an ungated xIELU MLP, `llama3` RoPE (its original context scaled down as
        # the llama3 tiny model's), untied embeddings.
        rope = {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": max(64, max_position // 8)}  # fmt: skip
        return transformers.ApertusConfig(head_dim=head_dim, hidden_act="xielu", attention_bias=False, mlp_bias=False,
                                          rope_parameters=rope, **common)  # fmt: skip
    if family == "stablelm":
        # stablelm-2-1_6b's fields: multi-head attention with q/k/v biases, RoPE on a quarter of each head, LayerNorms,
        # the sequential layer, SwiGLU without biases, untied.
        fields = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        return transformers.StableLmConfig(layer_norm_eps=1e-5, use_qkv_bias=True, qk_layernorm=False,
                                           use_parallel_residual=False, hidden_dropout=0.0, attention_dropout=0.0,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.25}, **fields)  # fmt: skip
    if family == "phi":
        # phi-2's fields (multi-head attention of 80-dim heads, RoPE on 0.4 of them, one LayerNorm before attention
        # and the MLP in parallel, biases everywhere and on lm_head, tanh GeLU, 4x MLP, untied; resid_pdrop 0.1).
        fields = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        return transformers.PhiConfig(layer_norm_eps=1e-5, hidden_act="gelu_new", resid_pdrop=0.1, embd_pdrop=0.0,
                                      attention_dropout=0.0, qk_layernorm=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.4},
                                      **{**fields, "intermediate_size": 4 * hidden})  # fmt: skip
    if family == "gpt_neox":
        # Pythia's fields (multi-head attention through the fused per-head query_key_value, RoPE on a quarter of each
        # head, the parallel residual with two LayerNorms, biases everywhere, exact GeLU, 4x MLP, untied embed_out).
        fields = {k: v for k, v in common.items() if k not in ("rms_norm_eps", "num_key_value_heads")}
        return transformers.GPTNeoXConfig(layer_norm_eps=1e-5, hidden_act="gelu", use_parallel_residual=True,
                                          attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.25},
                                          **{**fields, "intermediate_size": 4 * hidden})  # fmt: skip
    if family in ("cohere", "cohere2"):
        # Aya Expanse 8B's fields (Cohere: attention and the MLP in parallel on one bias-free LayerNorm, RoPE on
        # adjacent pairs, logits x 0.125, tied embeddings) and Command R7B's (Cohere2: logits x 0.25; sliding layers
        # with RoPE, full ones without, 3:1 shrunk to 1:1 with the last layer full; the window small enough that the
        # parity sequences pass it, larger than the serving test's sequences: vLLM 0.32 attends one key more there).
        fields = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        if family == "cohere":
            return transformers.CohereConfig(logit_scale=0.125, layer_norm_eps=1e-5, use_qk_norm=False,
                                             attention_bias=False, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 4000000.0},
                                             **fields)  # fmt: skip
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return transformers.Cohere2Config(logit_scale=0.25, layer_norm_eps=1e-5, sliding_window=32, layer_types=types,
                                          attention_bias=False, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 50000.0},
                                          **fields)  # fmt: skip
    if family == "nemotron":
        # Minitron-8B's fields: GQA, RoPE on the leading half of each head, LayerNorm1P (zero-centred weight, a bias),
        # an ungated ReLU-squared MLP, no biases, untied embeddings.
        fields = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return transformers.NemotronConfig(head_dim=head_dim, hidden_act="relu2", norm_eps=1e-5, attention_bias=False,
                                           mlp_bias=False, rope_parameters=rope, **fields)  # fmt: skip
    if family == "seed_oss":
        # Seed-OSS-36B's fields: GQA, q/k/v biases (none on o_proj), RoPE base 1e7, dropout 0.1 on the attention
        # probabilities and on each residual branch (in training only: the parity checks run in eval mode).
        return transformers.SeedOssConfig(head_dim=head_dim, attention_bias=True, attention_out_bias=False,
                                          mlp_bias=False, attention_dropout=0.1, residual_dropout=0.1,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
                                          **common)  # fmt: skip
    if family == "exaone4":
        # EXAONE-4.0-32B's fields, scaled down: sliding and global (NoPE) layers alternating (32B: 3 sliding to 1
        # global), output norms only, per-head q/k norms, `llama3` RoPE with its original context scaled down (as the
        # llama3 tiny model's) so the scaled low frequencies show.
        rope = {"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": max(64, max_position // 8)}  # fmt: skip
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return transformers.Exaone4Config(head_dim=head_dim, sliding_window=8, layer_types=types,
                                          rope_parameters=rope, **common)  # fmt: skip
    if family == "olmoe":
        # OLMoE-1B-7B's fields, scaled down: q/k norms over the whole projection, every layer sparse, softmax routing
        # not renormalised; rms_norm_eps 1e-5 (vLLM's OLMoE hard-codes it for the q/k norms).
        fields = {**common, "intermediate_size": hidden // 2, "rms_norm_eps": 1e-5}
        return transformers.OlmoeConfig(num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOPK, norm_topk_prob=False,
                                        clip_qkv=None, attention_bias=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                        **fields)  # fmt: skip
    if family == "olmo2":
        return transformers.Olmo2Config(attention_bias=False, rope_parameters={"rope_type": "default",
                                        "rope_theta": 500000.0}, **common)  # fmt: skip
    if family == "olmo3":
        # OLMo 3's 3:1 sliding:full pattern shrunk to 1:1 (the last layer is full, as in OLMo 3), and its YaRN on the
        # full layers (factor 8 over the original context, here scaled down so a CPU test reaches past it).
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        yarn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": max(64, max_position // 8)}  # fmt: skip
        rope = {"full_attention": yarn, "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}
        return transformers.Olmo3Config(attention_bias=False, sliding_window=8, layer_types=types,
                                        rope_parameters=rope, **common)  # fmt: skip
    if family == "qwen3_moe":
        # Qwen3-30B-A3B's fields (norm_topk_prob, every layer sparse), scaled down; the dense layers of
        # mlp_only_layers / decoder_sparse_step use intermediate_size.
        return transformers.Qwen3MoeConfig(head_dim=head_dim, attention_bias=False, use_sliding_window=False,
                                           num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOPK,
                                           moe_intermediate_size=hidden // 2, norm_topk_prob=True,
                                           decoder_sparse_step=1, mlp_only_layers=[],
                                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                           **common)  # fmt: skip
    if family == "granite":
        # Granite 3.3 8B's multipliers (attention 1 / head_dim, embedding 12, residual 0.22, logits / 16).
        return transformers.GraniteConfig(attention_bias=False, mlp_bias=False, attention_multiplier=1.0 / head_dim,
                                          embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=16.0,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
                                          **common)  # fmt: skip
    if family == "granite4":
        # granite-4.0-micro's fields: every layer attention (GraniteMoeHybrid without Mamba or experts), its
        # multipliers, the MLP as shared_mlp of `shared_intermediate_size` (intermediate_size set apart, unused).
        return transformers.GraniteMoeHybridConfig(layer_types=["attention"] * layers, num_local_experts=0,
                                                   shared_intermediate_size=common["intermediate_size"],
                                                   **{**common, "intermediate_size": 3 * hidden, "rms_norm_eps": 1e-5},
                                                   position_embedding_type="rope", attention_multiplier=1.0 / head_dim,
                                                   embedding_multiplier=12.0, residual_multiplier=0.22,
                                                   logits_scaling=10.0,
                                                   rope_parameters={"rope_type": "default",
                                                                    "rope_theta": 10000000.0})  # fmt: skip
    if family == "granitemoe":
        # granite-3.0-1b-a400m's fields (attention 1 / 64, embedding 12, residual 0.22, logits / 6; every layer sparse,
        # each expert intermediate_size wide), scaled down; transformers saves the experts stacked, as the hub has them.
        return transformers.GraniteMoeConfig(num_local_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOPK,
                                             attention_multiplier=1.0 / head_dim, embedding_multiplier=12.0,
                                             residual_multiplier=0.22, logits_scaling=6.0, attention_bias=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                             **{**common, "intermediate_size": hidden // 2})  # fmt: skip
    if family == "gpt_oss":
        # gpt-oss-20b's fields (sliding window on the even layers, YaRN with truncate false, every layer sparse, each
        # expert intermediate_size wide), scaled down: the window to 8, the original context to 128 (so the 600-token
        # parity sequence reaches past both).
        return transformers.GptOssConfig(head_dim=head_dim, num_local_experts=TINY_EXPERTS,
                                         num_experts_per_tok=TINY_TOPK, sliding_window=8, attention_bias=True,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                          "original_max_position_embeddings": 128},
                                         **{**common, "intermediate_size": hidden // 2,
                                            "rms_norm_eps": 1e-5})  # fmt: skip
    if family == "qwen2_moe":
        # Qwen1.5-MoE-A2.7B's fields (plain top-k, q/k/v biases, a shared expert 4x an expert's size), scaled down.
        return transformers.Qwen2MoeConfig(num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOPK,
                                           moe_intermediate_size=hidden // 2,
                                           shared_expert_intermediate_size=2 * hidden,
                                           norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                                           qkv_bias=True, use_sliding_window=False,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                           **common)  # fmt: skip
    if family == "mixtral":
        # Mixtral's experts have intermediate_size each.
        return transformers.MixtralConfig(head_dim=head_dim, num_local_experts=TINY_EXPERTS,
                                          num_experts_per_tok=TINY_TOPK, router_jitter_noise=0.0, sliding_window=None,
                                          **{**common, "intermediate_size": hidden // 2})  # fmt: skip
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _gemma3_tokenizer(vocab: int, out: Path):
    """The tiny tokenizer with Gemma 3's three image tokens as its last entries (`vocab` in all), which its processor
    finds by name (`tokenizer.boi_token`, ...)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = _build_tokenizer(vocab - len(GEMMA3_IMAGE_TOKENS))
    tokenizer.add_special_tokens({"extra_special_tokens": list(GEMMA3_IMAGE_TOKENS.values())})
    tokenizer.save_pretrained(out)
    return PreTrainedTokenizerFast.from_pretrained(out, extra_special_tokens=GEMMA3_IMAGE_TOKENS)


def _gemma3_multimodal_config(text, tokenizer, token_ids: dict[str, int]):
    """Gemma 3 4B-27B's multimodal config around the tiny text config: a one-layer SigLIP tower and the projector."""
    import transformers

    vision = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=GEMMA3_IMAGE["image_size"],
                                             patch_size=GEMMA3_IMAGE["patch_size"], vision_use_head=False)  # fmt: skip
    return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                     mm_tokens_per_image=GEMMA3_IMAGE["mm_tokens_per_image"],
                                     boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                                     image_token_index=tokenizer.image_token_id,
                                     tie_word_embeddings=text.tie_word_embeddings, **token_ids)  # fmt: skip


def _save_gemma3_processor(out: Path, tokenizer) -> None:
    """Gemma 3's processor (image processor and tokenizer), which vLLM loads to serve the checkpoint."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    size = GEMMA3_IMAGE["image_size"]
    Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": size, "width": size}), tokenizer=tokenizer,
                    image_seq_length=GEMMA3_IMAGE["mm_tokens_per_image"],
                    chat_template=tokenizer.chat_template).save_pretrained(out)  # fmt: skip


def _model_config(family: Family, *args, overrides: dict | None = None):
    """The family's config with `overrides` applied on top (transformers derives layer_types etc. from them)."""
    config = _family_config(family, *args)
    if not overrides:
        return config
    fields = config.to_dict()
    if "layer_types" not in overrides:
        fields.pop("layer_types", None)  # derived from the other fields: derive it again
    return type(config)(**{**fields, **overrides})


def _randomize(model, seed: int) -> None:
    """Fill every weight from one seeded generator so the files depend only on the seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                # Non-unit norm weights make a wrong converter mapping show up in logits.
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # xIELU's trained scalars: each layer its own
                param.copy_(noise)
            elif name.endswith(".sinks"):  # GPT-OSS's sink logits: as large as the attention scores, or larger
                param.copy_(noise)
            elif name.endswith("gate_up_proj_bias"):  # GPT-OSS: some gate and up inputs past its clamp at +-7
                param.copy_(4.0 * noise)
            else:
                param.copy_(INIT_STD * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # sigmoid routing's fixed expert bias: moves some choices
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen, dtype=torch.float32))


def make_tiny_model(
    path: str | Path,
    layers: int = 2,
    hidden: int = 128,
    vocab: int = 512,
    seed: int = 0,
    heads: int = 2,
    kv_heads: int | None = None,
    family: Family = "llama",
    intermediate: int | None = None,
    max_position: int = 1024,
    tie_embeddings: bool | None = None,
    config_overrides: dict | None = None,
) -> Path:
    """Write a random-weight model + tokenizer to `path` (float32 safetensors) and return the path.

    `config_overrides` are passed to the family's config class (e.g. Qwen3's `use_sliding_window`)."""
    import torch
    from transformers import AutoModelForCausalLM

    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    head_size = hidden // heads
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"head size hidden/heads = {head_size} is not supported by vLLM's CPU attention")
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    multimodal = family == "gemma3_mm"
    tokenizer = _gemma3_tokenizer(vocab, out) if multimodal else _build_tokenizer(vocab)
    token_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = _model_config(
        "gemma3" if multimodal else family, len(tokenizer), hidden, layers, heads, kv_heads,
        intermediate or 2 * hidden, max_position,
        family in TIED_BY_DEFAULT if tie_embeddings is None else tie_embeddings, token_ids,
        overrides=config_overrides,
    )
    if multimodal:
        config = _gemma3_multimodal_config(config, tokenizer, token_ids)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if multimodal:
        _save_gemma3_processor(out, tokenizer)
    (out / "scalarlm_tiny.json").write_text(
        json.dumps({"family": family, "layers": layers, "hidden": hidden, "vocab": len(tokenizer), "seed": seed})
    )
    logger.info("wrote tiny %s model to %s", family, out)
    return out


YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "original_max_position_embeddings": 128}
# Phi-4-mini's RoPE: longrope (short factors near 1, long ones growing with the wavelength) over 3/4 of each head, the
# original context scaled down to 512 (at most the served max_model_len, so vLLM keeps the short factors) and 8x it.
PHI4_MINI = {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 512,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0 + 0.02 * i for i in range(24)],
                                 "long_factor": [1.0 + 0.75 * i for i in range(24)]}}  # fmt: skip

# One tiny instance per trainer family (and per variant the trainer treats differently), as the parity tests
# build them: head size 64 (vLLM's CPU attention) except the 32-wide GQA Llama, 2 KV groups so TP=2 splits them.
FAMILY_TINY_MODELS: dict[str, dict] = {
    "llama-gqa": dict(family="llama", hidden=128, heads=4, kv_heads=2, seed=1),
    "llama3": dict(family="llama3", hidden=256, heads=4, kv_heads=2, seed=2),
    "mistral": dict(family="mistral", hidden=256, heads=4, kv_heads=2, seed=3),
    "qwen2-tied": dict(family="qwen2", hidden=128, heads=2, kv_heads=2, tie_embeddings=True),
    # yarn on Llama and Qwen2 (Qwen2.5's long-context setting), read by the same code as Qwen3's.
    "llama-yarn": dict(family="llama", hidden=256, heads=4, kv_heads=2, seed=21,
                       config_overrides={"rope_parameters": {**YARN_ROPE, "rope_theta": 500000.0}}),
    "qwen2-yarn": dict(family="qwen2", hidden=256, heads=4, kv_heads=2, seed=22,
                       config_overrides={"rope_parameters": YARN_ROPE}),
    "qwen3": dict(family="qwen3", hidden=256, heads=4, kv_heads=2, seed=4),
    # Sliding window on the layers from max_window_layers on, full attention below (per-layer, as transformers).
    "qwen3-sliding": dict(family="qwen3", hidden=256, heads=4, kv_heads=2, seed=7,
                          config_overrides={"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    # Qwen's long-context setting: yarn RoPE scaling (factor 4 over 32K in Qwen3), the original context scaled down so
    # the 600-token parity sequence reaches past it.
    "qwen3-yarn": dict(family="qwen3", hidden=256, heads=4, kv_heads=2, seed=15,
                       config_overrides={"rope_parameters": YARN_ROPE}),
    "smollm3": dict(family="smollm3", hidden=256, heads=4, kv_heads=2, seed=5),
    "phi3": dict(family="phi3", hidden=256, heads=4, kv_heads=2, seed=6),
    "phi4-mini": dict(family="phi3", hidden=256, heads=4, kv_heads=2, seed=18, max_position=4096,
                      config_overrides=PHI4_MINI),
    "gemma": dict(family="gemma", hidden=256, heads=4, kv_heads=4, seed=27),  # Gemma 7B's multi-head attention
    "gemma2": dict(family="gemma2", hidden=256, heads=4, kv_heads=2, seed=12),
    "gemma3": dict(family="gemma3", hidden=256, heads=4, kv_heads=2, seed=8),
    "olmo2": dict(family="olmo2", hidden=256, heads=4, kv_heads=2, seed=13),
    "ernie4.5": dict(family="ernie4_5", hidden=256, heads=4, kv_heads=2, seed=30),
    "exaone4": dict(family="exaone4", hidden=256, heads=4, kv_heads=2, seed=29),
    "olmoe": dict(family="olmoe", hidden=256, heads=4, kv_heads=4, seed=28),  # OLMoE-1B-7B's multi-head attention
    # Multi-head attention (OLMo 3 7B's), sliding and full layers alternating, YaRN on the full layers.
    "olmo3": dict(family="olmo3", hidden=256, heads=4, kv_heads=4, seed=14),
    "qwen3-moe": dict(family="qwen3_moe", hidden=256, heads=4, kv_heads=2, seed=9),
    # HF's other routing (top-k of the softmax, not renormalised), a dense layer between sparse ones, yarn RoPE.
    "qwen3-moe-mixed": dict(family="qwen3_moe", hidden=256, heads=4, kv_heads=2, layers=3, seed=10,
                            config_overrides={"norm_topk_prob": False, "mlp_only_layers": [1],
                                              "rope_parameters": YARN_ROPE}),
    "mixtral": dict(family="mixtral", hidden=256, heads=4, kv_heads=2, seed=11),
    "qwen2-moe": dict(family="qwen2_moe", hidden=256, heads=4, kv_heads=2, seed=16),
    "glm4-moe": dict(family="glm4_moe", hidden=256, heads=4, kv_heads=2, layers=3, seed=23),
    "deepseek-v3": dict(family="deepseek_v3", hidden=256, heads=4, kv_heads=4, layers=3, seed=24),
    # Moonlight's layout (DeepseekV3ForCausalLM too): one q_proj instead of a q latent, plain RoPE.
    "moonlight": dict(family="deepseek_v3", hidden=256, heads=4, kv_heads=4, layers=3, seed=25,
                      config_overrides={"q_lora_rank": None,
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}),
    "deepseek-v2-lite": dict(family="deepseek_v2", hidden=256, heads=4, kv_heads=4, layers=3, seed=26),
    "granite": dict(family="granite", hidden=256, heads=4, kv_heads=2, seed=17),
    "granite4": dict(family="granite4", hidden=256, heads=4, kv_heads=2, seed=31),
    "granite-moe": dict(family="granitemoe", hidden=256, heads=4, kv_heads=2, seed=32),
    "gpt-oss": dict(family="gpt_oss", hidden=256, heads=4, kv_heads=2, seed=33),
    "seed-oss": dict(family="seed_oss", hidden=256, heads=4, kv_heads=2, seed=34),
    "starcoder2": dict(family="starcoder2", hidden=256, heads=4, kv_heads=2, seed=35),
    "arcee": dict(family="arcee", hidden=256, heads=4, kv_heads=2, seed=36),
    "nemotron": dict(family="nemotron", hidden=256, heads=4, kv_heads=2, seed=37),
    "apertus": dict(family="apertus", hidden=256, heads=4, kv_heads=2, seed=38),
    "hunyuan": dict(family="hunyuan", hidden=256, heads=4, kv_heads=2, seed=39),
    "cohere": dict(family="cohere", hidden=256, heads=4, kv_heads=2, seed=40),
    # Command R+: Cohere's layers with a LayerNorm over each head of q and k, its weight per head; its logit_scale
    "command-r-plus": dict(family="cohere", hidden=256, heads=4, kv_heads=2, seed=47,
                           config_overrides={"use_qk_norm": True, "logit_scale": 0.8333333333333334}),
    "cohere2": dict(family="cohere2", hidden=256, heads=4, kv_heads=2, seed=41),
    # Gemma 3 4B-27B: the gemma3 text model inside the multimodal checkpoint, with a one-layer vision tower
    "gemma3-mm": dict(family="gemma3_mm", hidden=256, heads=4, kv_heads=2, seed=48),
    "stablelm": dict(family="stablelm", hidden=256, heads=4, kv_heads=4, seed=45),
    "phi": dict(family="phi", hidden=320, heads=4, kv_heads=4, seed=44),  # phi-2's 80-dim heads (RoPE on 32)
    "gpt-neox": dict(family="gpt_neox", hidden=256, heads=4, kv_heads=4, seed=42),  # Pythia's multi-head attention
    # GPT-NeoX's sequential layer (`use_parallel_residual` false: attention, then the MLP on its output), trained with
    # GPT-NeoX's dropouts (on the embeddings, both residual branches and the attention probabilities), and with
    # GPT-NeoX-20B's `gelu_fast` (transformers' FastGELU).
    "gpt-neox-sequential": dict(family="gpt_neox", hidden=256, heads=4, kv_heads=4, seed=43,
                                config_overrides={"use_parallel_residual": False, "hidden_dropout": 0.1,
                                                  "attention_dropout": 0.1, "hidden_act": "gelu_fast"}),
    "glm": dict(family="glm", hidden=256, heads=4, kv_heads=2, seed=20),
    "glm4": dict(family="glm4", hidden=256, heads=4, kv_heads=2, seed=19),
}
