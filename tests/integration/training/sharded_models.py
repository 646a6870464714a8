"""Tiny models saved as real checkpoints are: sharded safetensors (`model.safetensors.index.json`) in bf16 or fp16,
built locally from `make_tiny_model` (no downloads). Imported by tests next to it and by unit tests by path."""

from __future__ import annotations

import shutil
from pathlib import Path

from scalarlm.cli.tiny_model import make_tiny_model

SHARD_SIZE = "120KB"  # a tiny model (~1 MB in bf16) becomes ~8 files


def save_sharded(source: Path, dest: Path, dtype: str, max_shard_size: str = SHARD_SIZE) -> Path:
    """`source` re-saved in `dtype` ("bfloat16"/"float16") as sharded safetensors, with its tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    model.save_pretrained(dest, max_shard_size=max_shard_size)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not (dest / f.name).exists():
            shutil.copy2(f, dest / f.name)
    if not (dest / "model.safetensors.index.json").exists():
        raise RuntimeError(f"{dest} was not sharded")
    return dest


def sharded_tiny_model(root: Path, name: str, dtype: str, **tiny: object) -> Path:
    """A tiny model (`make_tiny_model(**tiny)`) saved sharded in `dtype` under `root/name`."""
    fp32 = make_tiny_model(root / f"{name}-fp32", **tiny)  # type: ignore[arg-type]
    return save_sharded(fp32, root / name, dtype)


def model_arch(model_dir: Path):
    """The trainer's ModelArch for a checkpoint (families layer if present, else the Llama-family reader)."""
    try:
        from scalarlm.training.model import model_arch as read
    except ImportError:
        from scalarlm.training import hf_io
        from scalarlm.training.model import arch_from_hf_config

        names = hf_io.tensor_names(model_dir)
        bias = any(n.endswith("q_proj.bias") for n in names)
        return arch_from_hf_config(hf_io.read_config(model_dir), qkv_bias=bias)
    return read(model_dir)


def put_in_hub_cache(model_dir: Path, cache: Path, repo_id: str, commit: str = "c0ffee" + "0" * 34) -> Path:
    """Lay a model directory out as huggingface_hub's cache does (blobs, snapshot symlinks, refs/main)."""
    import hashlib

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copy2(f, blob)
            (snapshot / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot
