"""`scalarlm dequantize`: a quantized checkpoint rewritten in bf16, the layout the trainer trains and vLLM serves and
hot-swaps unquantized. Two formats the hub's releases use:

- MXFP4 (the hub's gpt-oss-20b and gpt-oss-120b): each `<name>_blocks` / `<name>_scales` pair becomes `<name>`: the
  blocks hold two e2m1 values a byte (low nibble first), 32 values a scale, each scale a power of two (2^(s - 127)),
  as transformers decodes them (`integrations/mxfp4.py`); the result is transposed to the x @ W layout GPT-OSS's
  experts compute with (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]). Every value is exact in bf16 (at most two
  significant bits times a power of two).
- Fine-grained FP8 (`quant_method` fp8 with `weight_block_size`: DeepSeek-V3/R1/V3.1's own releases, Qwen3's FP8
  releases): each float8 `<name>` times its `<name>_scale_inv`, one scale per block of
  `weight_block_size` (the last block of a dimension may be partial, as DeepSeek's own dequantization reads it), in
  fp32, then rounded to bf16, as transformers dequantizes them on load (`Fp8Dequantize`). Scales stored as fp32,
  bf16, float8_e8m0 or uint8 exponents (2^(s - 127)) are read.

The other tensors are copied as stored, `quantization_config` leaves config.json, and the tokenizer and chat template
files come along. One source shard is decoded and written at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from scalarlm.training import hf_io

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"
SCALE_INV = "_scale_inv"
FORMATS = ("mxfp4", "fp8")
# An entry reader: (the source's weights, a tensor name) -> (the name to write, its tensor, whether it was decoded),
# or None for a name that is read with another (a scale).
Entry = Callable[[hf_io.Weights, str], "tuple[str, Tensor, bool] | None"]


def mxfp4_to_float(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """[..., rows, G, 16] uint8 blocks and [..., rows, G] uint8 scales -> [..., G * 32, rows] in `dtype` (the x @ W
    layout: a row of the stored matrix is a column of the result)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         "([..., rows, groups, 16] and [..., rows, groups])")  # fmt: skip
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)  # [..., rows, G, 32]
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def fp8_to_float(weight: Tensor, scale_inv: Tensor, block: tuple[int, int],
                 dtype: torch.dtype = torch.bfloat16) -> Tensor:  # fmt: skip
    """[..., rows, cols] float8 values times their [..., ceil(rows / block[0]), ceil(cols / block[1])] block scales
    -> [..., rows, cols] in `dtype`, computed in fp32."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape[-2:]) != grid or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"FP8 weight {tuple(weight.shape)} and scales {tuple(scale_inv.shape)} do not match blocks of "
                         f"{list(block)} (expected scales [..., {grid[0]}, {grid[1]}])")  # fmt: skip
    if scale_inv.dtype == torch.uint8:  # e8m0 exponents stored as bytes
        scales = torch.ldexp(torch.ones(scale_inv.shape), scale_inv.to(torch.int32) - 127)
    else:
        scales = scale_inv.to(torch.float32)
    full = scales.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * full).to(dtype)


def _mxfp4_entry(weights: hf_io.Weights, name: str, dtype: torch.dtype) -> tuple[str, Tensor, bool] | None:
    if name.endswith(SCALES):
        return None
    if name.endswith(BLOCKS):
        base = name.removesuffix(BLOCKS)
        return base, mxfp4_to_float(weights[name], weights[base + SCALES], dtype), True
    return name, weights[name], False


def _fp8_entry(weights: hf_io.Weights, name: str, dtype: torch.dtype,
               block: tuple[int, int]) -> tuple[str, Tensor, bool] | None:  # fmt: skip
    if name.endswith(SCALE_INV):
        return None
    if name + SCALE_INV in weights:
        return name, fp8_to_float(weights[name], weights[name + SCALE_INV], block, dtype), True
    return name, weights[name], False  # kept in high precision (`modules_to_not_convert`: norms, embeddings, head)


def _entry_reader(src: Path, quantization: dict, dtype: torch.dtype) -> Entry:
    """How `src`'s tensors are read for its `quantization_config`; ValueError naming what is not supported."""
    method = quantization.get("quant_method")
    if method not in FORMATS:
        raise ValueError(f"{src} is not an MXFP4 or fine-grained FP8 checkpoint (quantization_config.quant_method: "
                         f"{method})")  # fmt: skip
    if method == "mxfp4":
        return partial(_mxfp4_entry, dtype=dtype)
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{src}: an FP8 checkpoint without block scales (quantization_config.weight_block_size: "
                         f"{block}) is not supported; fine-grained FP8 (e.g. [128, 128]) is")  # fmt: skip
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{src}: FP8 activation_scheme {quantization['activation_scheme']!r} is not supported "
                         "(dynamic is)")  # fmt: skip
    return partial(_fp8_entry, dtype=dtype, block=(block[0], block[1]))


def dequantize_checkpoint(src: Path, dest: Path, dtype: torch.dtype = torch.bfloat16) -> tuple[str, list[str]]:
    """Write the quantized checkpoint in `src` to `dest` with every quantized tensor decoded to `dtype`; its format
    (`FORMATS`) and the names decoded. ValueError if `src` is not in a format this reads."""
    src, dest = Path(src), Path(dest)
    config = json.loads((src / "config.json").read_text())
    quantization = config.get("quantization_config") or {}
    entry = _entry_reader(src, quantization, dtype)
    dest.mkdir(parents=True, exist_ok=True)
    decoded: list[str] = []
    with hf_io.Weights(src, dtype=None) as weights:
        by_file: dict[Path, list[str]] = {}
        for name, path in weights.files.items():
            by_file.setdefault(path, []).append(name)
        files = sorted(by_file)
        index: dict[str, str] = {}
        total = 0
        for number, path in enumerate(files, 1):
            shard: dict[str, Tensor] = {}
            for name in sorted(by_file[path]):
                read = entry(weights, name)
                if read is not None:
                    out, tensor, was_decoded = read
                    shard[out] = tensor
                    if was_decoded:
                        decoded.append(out)
            filename = "model.safetensors" if len(files) == 1 else f"model-{number:05d}-of-{len(files):05d}.safetensors"
            save_file(shard, str(dest / filename), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, filename))
            total += sum(t.numel() * t.element_size() for t in shard.values())
    if len(files) > 1:
        hf_io.write_index(dest, index, total)
    config.pop("quantization_config")
    (dest / "config.json").write_text(json.dumps(hf_io.config_in_dtype(config, dtype), indent=2, sort_keys=True) + "\n")
    hf_io.copy_support_files(src, dest)
    return quantization["quant_method"], decoded
