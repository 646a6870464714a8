"""`scalarlm dequantize`: the hub's MXFP4 GPT-OSS checkpoints rewritten in bf16 hold exactly the weights transformers
decodes from them (its `Mxfp4Config(dequantize=True)`), the trainer accepts the copy and refuses the original by name,
and the command runs end to end (two source shards, an index, the tokenizer carried along)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.dequantize import dequantize_checkpoint, mxfp4_to_float
from scalarlm.training.model import model_arch


def _mxfp4_copy(bf16: Path, dest: Path) -> Path:
    """`bf16` (a tiny GPT-OSS) as the hub stores gpt-oss: every expert tensor as random MXFP4 blocks and scales, in two
    shards with an index, and its quantization_config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(bf16, dest)
    (dest / "model.safetensors").unlink()
    tensors = load_file(str(bf16 / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        experts, rows_in, cols_out = tensors.pop(name).shape  # x @ W: the blocks hold [E, out, in / 32, 16]
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, cols_out, rows_in // 32, 16), generator=gen,
                                                  dtype=torch.uint8)  # fmt: skip
        tensors[name + "_scales"] = torch.randint(118, 128, (experts, cols_out, rows_in // 32), generator=gen,
                                                  dtype=torch.uint8)  # fmt: skip
    shards = [{n: t for n, t in tensors.items() if ".layers.0." in n}, {n: t for n, t in tensors.items()
                                                                         if ".layers.0." not in n}]  # fmt: skip
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        save_file(shard, str(dest / f"model-{k:05d}-of-00002.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, f"model-{k:05d}-of-00002.safetensors"))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model

    root = tmp_path_factory.mktemp("mxfp4")
    return _mxfp4_copy(make_tiny_model(root / "bf16", **FAMILY_TINY_MODELS["gpt-oss"]), root / "gpt-oss-mxfp4")


def test_e2m1_values_and_power_of_two_scales_in_the_x_at_w_layout() -> None:
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)  # one stored row, one group of 32 values
    blocks[0, 0, 0] = 0x2F  # low nibble 15 (-6.0) first, then high nibble 2 (1.0)
    blocks[0, 0, 1] = 0x97  # 7 (6.0), then 9 (-0.5)
    values = mxfp4_to_float(blocks, torch.tensor([[128]], dtype=torch.uint8), torch.float32)  # scale 2^(128 - 127)
    assert values.shape == (32, 1)  # transposed: the stored row is a column
    assert values[:4, 0].tolist() == [-12.0, 2.0, 12.0, -1.0] and not values[4:].any()
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_to_float(blocks, torch.zeros(1, 2, dtype=torch.uint8))


def test_the_bf16_copy_holds_what_transformers_decodes_and_the_trainer_takes_it(mxfp4: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    with pytest.raises(InvalidRequest, match=r"quantized \(quantization_config: mxfp4\).*scalarlm dequantize DIR -o OUT"):
        model_arch(mxfp4)
    out = tmp_path / "bf16"
    decoded = dequantize_checkpoint(mxfp4, out)
    assert sorted(decoded) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                     for p in ("gate_up_proj", "down_proj"))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors.index.json").exists()
    assert model_arch(out).family == "gpt_oss"

    theirs = AutoModelForCausalLM.from_pretrained(mxfp4, dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True))  # fmt: skip
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    their_params = dict(theirs.named_parameters())
    assert set(their_params) == {n for n, _ in ours.named_parameters()}
    for name, param in ours.named_parameters():
        assert torch.equal(param, their_params[name].float()), name
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs.float()(ids).logits)


def test_the_command_writes_the_copy_and_names_a_checkpoint_it_cannot_read(mxfp4: Path, tmp_path: Path) -> None:
    run = [sys.executable, "-m", "scalarlm.cli", "dequantize"]
    done = subprocess.run([*run, str(mxfp4), "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "4 MXFP4 tensors decoded to bfloat16" in done.stdout, done.stderr[-2000:]
    again = subprocess.run([*run, str(tmp_path / "out"), "-o", str(tmp_path / "twice")], capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert again.returncode == 2 and "is not an MXFP4 checkpoint (quantization_config.quant_method: None)" in again.stderr
