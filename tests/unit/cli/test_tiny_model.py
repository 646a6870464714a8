"""The tiny model loads in transformers, matches its tokenizer, and renders chats."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from scalarlm.cli.main import main
from scalarlm.cli.tiny_model import make_tiny_model


def test_tiny_model_loads_in_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = model.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.hidden_size // config.num_attention_heads == 64
    assert config.vocab_size == len(tokenizer) == 512
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"
    assert str(next(model.parameters()).dtype) == "torch.float32"

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "What is 2 + 2?" in text and text.endswith("<|assistant|>\n")
    ids = tokenizer("What is 12 + 7?").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "What is 12 + 7?"


def test_greedy_outputs_differ_between_prompts(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    outs = set()
    for prompt in ("Hello", "What is 3 + 4?", "The capital of France"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        outs.add(tuple(out[0, ids.shape[1]:].tolist()))
    assert len(outs) == 3


def _digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_same_files_via_cli(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert main(["make-tiny-model", str(tmp_path / "again")]) == 0
    assert _digest(tmp_path / "again") == _digest(tiny_model_dir)


def test_qwen2_family_has_qkv_bias_and_tied_embeddings(tmp_path: Path) -> None:
    from safetensors import safe_open

    path = make_tiny_model(tmp_path / "q", family="qwen2", kv_heads=1, tie_embeddings=True, seed=3)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    with safe_open(path / "model.safetensors", "pt") as f:
        bias = f.get_tensor("model.layers.0.self_attn.q_proj.bias")
        assert bias.abs().sum() > 0
        assert "lm_head.weight" not in f.keys()


def test_rejects_unsupported_head_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head size"):
        make_tiny_model(tmp_path / "bad", hidden=96, heads=4)


def test_peft_lora_attaches_and_runs(tiny_model_dir: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in model.parameters()) // 10
    logits = model(torch.tensor([[0, 5, 6]])).logits
    assert logits.shape == (1, 3, 512)


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3", "smollm3", "phi3", "gemma3"])
def test_every_family_builds_offline_with_its_real_fields(tmp_path: Path, family: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    assert main(["make-tiny-model", str(tmp_path / family), "--family", family, "--heads", "2"]) == 0
    config = json.loads((tmp_path / family / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM's CPU attention
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        assert 0 <= config[key] < config["vocab_size"], key  # Phi-3 and SmolLM3 default to ids past a tiny vocab
    fields = {"llama3": ("rope_parameters", "rope_type", "llama3"), "mistral": ("sliding_window", None, 8),
              "smollm3": ("no_rope_layers", None, [1, 0]), "qwen3": ("architectures", None, ["Qwen3ForCausalLM"]),
              "phi3": ("architectures", None, ["Phi3ForCausalLM"]),
              "gemma3": ("layer_types", None, ["sliding_attention", "full_attention"])}  # fmt: skip
    key, sub, value = fields[family]
    assert (config[key][sub] if sub else config[key]) == value
    model = AutoModelForCausalLM.from_pretrained(tmp_path / family)
    assert model(torch.tensor([[0, 5, 6]])).logits.shape == (1, 3, config["vocab_size"])
    if family == "phi3":
        assert "model.layers.0.self_attn.qkv_proj.weight" in model.state_dict()
