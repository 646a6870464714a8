"""`scalarlm dequantize`: an MXFP4 checkpoint (the hub's gpt-oss-20b and gpt-oss-120b) rewritten in bf16, the layout
the trainer trains and vLLM serves and hot-swaps unquantized.

Each `<name>_blocks` / `<name>_scales` pair becomes `<name>`: the blocks hold two e2m1 values a byte (low nibble
first), 32 values a scale, each scale a power of two (2^(s - 127)), as transformers decodes them
(`integrations/mxfp4.py`); the result is transposed to the x @ W layout GPT-OSS's experts compute with
(`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]). Every value is exact in bf16 (at most two significant bits times
a power of two). The other tensors are copied as stored, `quantization_config` leaves config.json, and the tokenizer
and chat template files come along. One source shard is decoded and written at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from scalarlm.training import hf_io

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"


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


def dequantize_checkpoint(src: Path, dest: Path, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Write the MXFP4 checkpoint in `src` to `dest` with every quantized tensor decoded to `dtype`; the names
    decoded. ValueError if `src` is not an MXFP4 checkpoint."""
    src, dest = Path(src), Path(dest)
    config = json.loads((src / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method != "mxfp4":
        raise ValueError(f"{src} is not an MXFP4 checkpoint (quantization_config.quant_method: {method})")
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
                if name.endswith(SCALES):
                    continue
                if name.endswith(BLOCKS):
                    base = name.removesuffix(BLOCKS)
                    shard[base] = mxfp4_to_float(weights[name], weights[base + SCALES], dtype)
                    decoded.append(base)
                else:
                    shard[name] = weights[name]
            filename = "model.safetensors" if len(files) == 1 else f"model-{number:05d}-of-{len(files):05d}.safetensors"
            save_file(shard, str(dest / filename), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, filename))
            total += sum(t.numel() * t.element_size() for t in shard.values())
    if len(files) > 1:
        hf_io.write_index(dest, index, total)
    config.pop("quantization_config")
    (dest / "config.json").write_text(json.dumps(hf_io.config_in_dtype(config, dtype), indent=2, sort_keys=True) + "\n")
    hf_io.copy_support_files(src, dest)
    return decoded
