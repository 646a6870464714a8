"""`scalarlm dequantize`: the hub's MXFP4 GPT-OSS checkpoints and fine-grained FP8 checkpoints (DeepSeek-V3's, Qwen3's
FP8 releases) rewritten in bf16 hold exactly the weights transformers decodes from them (its `Mxfp4Config(dequantize=
True)`, its FP8 dequantization on a machine without a GPU), the trainer accepts the copy and refuses the original by
name, and the command runs end to end (two source shards, an index, the tokenizer carried along)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.dequantize import dequantize_checkpoint, fp8_to_float, mxfp4_to_float
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
    method, decoded = dequantize_checkpoint(mxfp4, out)
    assert method == "mxfp4" and sorted(decoded) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
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
    refusal = "is not an MXFP4 or fine-grained FP8 checkpoint (quantization_config.quant_method: None)"
    assert again.returncode == 2 and refusal in again.stderr


def _fp8_copy(bf16: Path, dest: Path, block: int = 128) -> Path:
    """`bf16` (a tiny Qwen3) as the hub's FP8 releases store it: every projection's weight in float8 e4m3, scaled per
    `block` x `block` block to use e4m3's range (scale = the block's largest |w| / 448), with its `weight_scale_inv`;
    embeddings, norms and the head as they were; the release's quantization_config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(bf16, dest)
    tensors = load_file(str(bf16 / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("proj.weight", "proj_with_mqa.weight"))]:
        weight = tensors.pop(name)
        rows, cols = weight.shape
        grid = (-(-rows // block), -(-cols // block))
        padded = torch.zeros(grid[0] * block, grid[1] * block)
        padded[:rows, :cols] = weight
        blocks = padded.reshape(grid[0], block, grid[1], block)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        quantized = (blocks / scale[:, None, :, None]).reshape(grid[0] * block, grid[1] * block)[:rows, :cols]
        tensors[name] = quantized.to(torch.float8_e4m3fn)
        tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [block, block]}  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model

    root = tmp_path_factory.mktemp("fp8")
    return _fp8_copy(make_tiny_model(root / "bf16", **FAMILY_TINY_MODELS["qwen3"]), root / "qwen3-fp8")


def test_fp8_blocks_scale_their_values_including_partial_blocks_at_the_edges() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(5, 7, generator=gen) * 100).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 3, generator=gen) + 0.5  # blocks of 2 x 3: the last row and column blocks are partial
    expected = torch.empty(5, 7)
    for r in range(5):
        for c in range(7):
            expected[r, c] = weight[r, c].float() * scales[r // 2, c // 3]
    assert torch.equal(fp8_to_float(weight, scales, (2, 3), torch.float32), expected)
    assert torch.equal(fp8_to_float(weight, scales, (2, 3)), expected.to(torch.bfloat16))
    exponents = torch.tensor([[126, 127, 130]] * 3, dtype=torch.uint8)  # e8m0 bytes: 2^(s - 127)
    powers = torch.tensor([0.5, 1.0, 8.0])
    assert torch.equal(fp8_to_float(weight, exponents, (2, 3), torch.float32),
                       weight.float() * powers.repeat_interleave(3)[:7])  # fmt: skip
    e8m0 = powers.expand(3, 3).to(torch.float8_e8m0fnu)  # the same scales as torch's e8m0 dtype (DeepSeek-V4's)
    assert torch.equal(fp8_to_float(weight, e8m0, (2, 3), torch.float32),
                       weight.float() * powers.repeat_interleave(3)[:7])  # fmt: skip
    with pytest.raises(ValueError, match=r"do not match blocks of \[2, 2\] \(expected scales \[..., 3, 4\]\)"):
        fp8_to_float(weight, scales, (2, 2))


def test_the_fp8_copy_holds_what_transformers_decodes_and_the_trainer_takes_it(fp8: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    with pytest.raises(InvalidRequest, match=r"quantized \(quantization_config: fp8\).*scalarlm dequantize DIR -o OUT"):
        model_arch(fp8)
    method, decoded = dequantize_checkpoint(fp8, tmp_path / "fp32", torch.float32)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert method == "fp8" and sorted(decoded) == sorted(
        f"model.layers.{i}.{'mlp' if p.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}.{p}.weight"
        for i in range(2) for p in projections)  # fmt: skip
    assert model_arch(tmp_path / "fp32").family == "qwen3"
    # transformers dequantizes an FP8 checkpoint on load where there is no GPU: in fp32, as ours above
    theirs = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32)
    their_params = dict(theirs.named_parameters())
    assert set(their_params) == {n for n, _ in ours.named_parameters()}
    for name, param in ours.named_parameters():
        assert torch.equal(param, their_params[name]), name
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
    # the bf16 copy (the command's): the decoded values rounded once, the rest as stored (here fp32)
    dequantize_checkpoint(fp8, tmp_path / "bf16")
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    for name, param in bf16.named_parameters():
        rounded = their_params[name].to(torch.bfloat16).float() if name in decoded else their_params[name]
        assert torch.equal(param, rounded), name


def test_the_command_decodes_fp8_and_refuses_fp8_without_block_scales(fp8: Path, tmp_path: Path) -> None:
    run = [sys.executable, "-m", "scalarlm.cli", "dequantize"]
    done = subprocess.run([*run, str(fp8), "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "14 FP8 tensors decoded to bfloat16" in done.stdout, done.stderr[-2000:]
    per_tensor = tmp_path / "per-tensor"
    shutil.copytree(fp8, per_tensor)
    config = json.loads((per_tensor / "config.json").read_text())
    config["quantization_config"].pop("weight_block_size")
    (per_tensor / "config.json").write_text(json.dumps(config))
    refused = subprocess.run([*run, str(per_tensor), "-o", str(tmp_path / "no")], capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert refused.returncode == 2 and "without block scales" in refused.stderr and not (tmp_path / "no").exists()


def test_a_deepseek_v3_fp8_release_comes_back_within_fp8_rounding_and_trains(tmp_path: Path) -> None:
    """DeepSeek-V3's layout (its kv down projection's 576 rows end in a partial 128-block, which transformers' own
    dequantization refuses): every decoded weight is the original within e4m3's rounding of its block."""
    from safetensors.torch import load_file

    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model

    bf16 = make_tiny_model(tmp_path / "bf16", **FAMILY_TINY_MODELS["deepseek-v3"])
    method, decoded = dequantize_checkpoint(_fp8_copy(bf16, tmp_path / "fp8"), tmp_path / "out", torch.float32)
    original, ours = load_file(str(bf16 / "model.safetensors")), load_file(str(tmp_path / "out/model.safetensors"))
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in decoded and original.keys() == ours.keys()
    for name in decoded:
        # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, and of its block's largest (448 x scale) at worst
        assert ((ours[name] - original[name]).abs() <= 2**-4 * original[name].abs().max()).all(), name
    assert model_arch(tmp_path / "out").family == "deepseek_v3"
