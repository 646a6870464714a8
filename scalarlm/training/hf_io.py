"""Read and write Hugging Face checkpoint directories (safetensors weights, config.json, tokenizer files)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from scalarlm.protocol.errors import InvalidRequest

# Files of a base model that are weights or weight indexes: never copied into a published checkpoint.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
_SKIP_NAMES = {"config.json", "manifest.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
_MAX_COPIED_FILE = 64 * 1024 * 1024


def read_config(model_dir: Path) -> dict[str, Any]:
    """The model's `config.json` as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise InvalidRequest(f"base model {model_dir} has no config.json (expected a local HF model directory)")
    return json.loads(path.read_text())


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"base model {model_dir} has no *.safetensors weights")
    return files


def tensor_names(model_dir: Path) -> set[str]:
    """Names of every tensor in the model's safetensors files (reads headers only)."""
    names: set[str] = set()
    for f in _weight_files(model_dir):
        with safe_open(f, framework="pt") as sf:
            names.update(sf.keys())
    return names


def load_weights(model_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Every tensor of the model's safetensors files, cast to `dtype`."""
    out: dict[str, Tensor] = {}
    for f in _weight_files(model_dir):
        out.update({k: v.to(dtype) for k, v in load_file(f).items()})
    return out


def copy_support_files(base_dir: Path, dest: Path) -> None:
    """Hard-link (else copy) tokenizer, generation config and chat template files (not weights, not config.json).

    Linking keeps every publish cheap (sessions publish after each step); the files are never written in place.
    """
    for f in Path(base_dir).iterdir():
        if (
            f.is_file()
            and f.name not in _SKIP_NAMES
            and not f.name.endswith(_WEIGHT_SUFFIXES)
            and f.stat().st_size <= _MAX_COPIED_FILE
        ):
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copy2(f, dest / f.name)


def write_checkpoint(dest: Path, state: dict[str, Tensor], base_dir: Path, config: dict[str, Any]) -> None:
    """Write an HF checkpoint: model.safetensors (HF names), config.json, the base model's tokenizer files."""
    dtype = next(iter(state.values())).dtype
    config = dict(config)
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
    save_file({k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copy_support_files(base_dir, dest)
