"""Read a local HF checkpoint's `config.json` and tensor names without torch (safetensors headers only).

The control plane calls this at submission and the trainer at start, so both refuse the same models.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from scalarlm.protocol.errors import InvalidRequest

_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


def read_config(model_dir: Path) -> dict[str, Any]:
    """The model's `config.json` as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InvalidRequest(f"base model {model_dir} has no config.json (expected a local HF model directory)",
                             param="model")  # fmt: skip
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidRequest(f"base model {model_dir}: config.json is unreadable: {e}", param="model") from None


def _header_names(path: Path) -> set[str]:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise InvalidRequest(f"{path.name} is not a safetensors file", param="model")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise InvalidRequest(f"{path.name}: safetensors header too large", param="model")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InvalidRequest(f"{path.name}: unreadable safetensors header", param="model") from None
    return {name for name in header if name != "__metadata__"}


def tensor_names(model_dir: Path) -> set[str]:
    """Names of every tensor in the checkpoint: from `model.safetensors.index.json`, else every file's header."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            raise InvalidRequest(f"base model {model_dir}: unreadable model.safetensors.index.json",
                                 param="model") from None  # fmt: skip
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"base model {model_dir} has no *.safetensors weights", param="model")
    names: set[str] = set()
    for f in files:
        names |= _header_names(f)
    return names
