"""Export a published checkpoint: the adapter as it is, or merged full weights (LoRA folded into its base).

The merge reads and writes safetensors files directly (NumPy only; the control plane imports no torch) and
computes what PEFT's `merge_and_unload()` does on CPU: `W + (B @ A) * scaling` per adapted linear layer, with
`scaling = lora_alpha / r` (`/ sqrt(r)` with rsLoRA). The delta is computed in fp32 (PEFT loads adapters in fp32)
and the sum rounded once to the weight's dtype (bf16 round-to-nearest-even, as torch casts).
A merged export keeps the base model's file layout (shards and index), its config and tokenizer files.
`tar_stream` yields an uncompressed tar of a directory chunk by chunk, so an export streams without a copy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scalarlm.checkpoint.jobdir import JobDir
from scalarlm.checkpoint.publish import latest_step, list_steps, read_manifest
from scalarlm.protocol.errors import InvalidRequest, NotFound

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
INDEX_NAME = "model.safetensors.index.json"
EXPORT_MANIFEST = "export.json"
PEFT_PREFIX = "base_model.model."
# A multimodal model's parts as transformers (4.52+) names them in its module tree, where PEFT's adapter keys name
# them, and as its checkpoints name them (Gemma 3 4B-27B as transformers 5 saves it, and as the hub's checkpoints hold
# the SigLIP tower).
MODULE_TREE_NAMES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
                     ("model.vision_tower.", "vision_tower.vision_model."),
                     ("model.multi_modal_projector.", "multi_modal_projector."))  # fmt: skip
_CHUNK = 1 << 20
_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}  # fmt: skip


# --- safetensors, read and written without a framework ----------------------------------------------------------


def read_safetensors(path: Path) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """{name: (safetensors dtype, array)} and the file's metadata; bf16 arrays hold the raw uint16 bits."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    (length,) = struct.unpack("<Q", raw[:8].tobytes())
    header = json.loads(raw[8 : 8 + length].tobytes())
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        dtype = info["dtype"]
        if dtype not in _NUMPY:
            raise InvalidRequest(f"{path.name}: tensor {name} has dtype {dtype}, which export cannot merge")
        start, end = info["data_offsets"]
        array = raw[base + start : base + end].view(_NUMPY[dtype]).reshape(info["shape"])
        tensors[name] = (dtype, array)
    return tensors, metadata


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
    """Write tensors (same shape as `read_safetensors` returns) as a safetensors file, via a temp name."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, array) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())
    os.replace(tmp, path)


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does when it casts float32 to bfloat16."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    nan = np.isnan(values)
    return np.where(nan, 0x7FC0, rounded).astype(np.uint16)


def add_delta(dtype: str, weight: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """`weight + delta` computed in fp32 and rounded once to the weight's dtype, as PEFT's merge does (it loads
    adapters in fp32, so its `weight.data += delta` promotes to fp32 and rounds the sum)."""
    if dtype == "F32":
        return (weight + delta.astype(np.float32)).astype(np.float32)
    if dtype == "BF16":
        return _f32_to_bf16(_bf16_to_f32(weight) + delta)
    if dtype == "F16":
        return (weight.astype(np.float32) + delta).astype(np.float16)
    raise InvalidRequest(f"cannot merge LoRA into a {dtype} weight")


# --- LoRA merge -----------------------------------------------------------------------------------------------------


def lora_deltas(adapter_dir: Path) -> dict[str, np.ndarray]:
    """{base weight name: (B @ A) * scaling in fp32} for every adapted module of a PEFT adapter directory."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise InvalidRequest("only plain LoRA adapters can be merged (not DoRA or other PEFT types)")
    if config.get("fan_in_fan_out"):
        raise InvalidRequest("fan_in_fan_out adapters cannot be merged here")
    tensors, _ = read_safetensors(adapter_dir / "adapter_model.safetensors")
    deltas = {}
    for name, (dtype, a) in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[: -len(".lora_A.weight")]
        b_dtype, b = tensors[module + ".lora_B.weight"]
        short = module.removeprefix(PEFT_PREFIX)
        r = int(_pattern(config.get("rank_pattern"), short, config["r"]))
        alpha = float(_pattern(config.get("alpha_pattern"), short, config["lora_alpha"]))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        deltas[short + ".weight"] = (_as_f32(b_dtype, b) @ _as_f32(dtype, a)) * np.float32(scaling)
    if not deltas:
        raise InvalidRequest(f"{adapter_dir.name}: the adapter has no LoRA weights")
    return deltas


def _pattern(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's per-module rank/alpha override: a key that names the module or its trailing path."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key):
            return value
    return default


def _as_f32(dtype: str, array: np.ndarray) -> np.ndarray:
    return _bf16_to_f32(array) if dtype == "BF16" else array.astype(np.float32)


def weight_files(model_dir: Path) -> list[str]:
    """The safetensors files of a model directory (from its index when sharded)."""
    index = model_dir / INDEX_NAME
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (model_dir / "model.safetensors").exists():
        return ["model.safetensors"]
    raise InvalidRequest(f"base model {model_dir} has no safetensors weights to merge into")


def merge_lora(base_dir: Path, adapter_dir: Path, dest: Path) -> None:
    """Write base + adapter as full weights into `dest` (the base's config, tokenizer and shard layout)."""
    files = {name: read_safetensors(base_dir / name) for name in weight_files(base_dir)}
    base_names = {tensor for tensors, _ in files.values() for tensor in tensors}
    deltas = {checkpoint_name(name, base_names): delta for name, delta in lora_deltas(adapter_dir).items()}
    copy_files(base_dir, dest, skip_weights=True)
    for name, (tensors, metadata) in files.items():
        merged = {}
        for tensor, (dtype, array) in tensors.items():
            delta = deltas.pop(tensor, None)
            if delta is not None:
                if delta.shape != array.shape:
                    raise InvalidRequest(f"adapter delta for {tensor} is {delta.shape}, the weight {array.shape}")
                array = add_delta(dtype, array, delta)
            merged[tensor] = (dtype, array)
        write_safetensors(dest / name, merged, metadata or {"format": "pt"})
    if deltas:
        raise InvalidRequest(f"the adapter adapts weights the base model lacks: {', '.join(sorted(deltas)[:3])}")


def checkpoint_name(name: str, base_names: set[str]) -> str:
    """The base checkpoint's name of the weight an adapter key names (`MODULE_TREE_NAMES`; otherwise `name`)."""
    if name not in base_names:
        for tree, saved in MODULE_TREE_NAMES:
            if name.startswith(tree) and saved + name[len(tree) :] in base_names:
                return saved + name[len(tree) :]
    return name


def copy_files(source: Path, dest: Path, skip_weights: bool = False, skip: tuple[str, ...] = ()) -> None:
    """Copy a model directory's plain files (tokenizer, config, ...), optionally without its weights."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(source).iterdir()):
        if not f.is_file() or f.name in skip:
            continue
        if skip_weights and (f.name.endswith(".safetensors") or f.name == INDEX_NAME or f.name.endswith(".bin")):
            continue
        shutil.copy2(f.resolve(), dest / f.name)


# --- what an export is ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportPlan:
    """What to export: the job's checkpoint `step` (its `kind`), merged or as the adapter."""

    job_id: str
    step: int
    kind: str
    merged: bool
    step_dir: Path
    base_model: Path

    @property
    def name(self) -> str:
        return f"{self.job_id}-step{self.step}-{'merged' if self.merged else self.kind}"


def plan_export(job: JobDir, step: int | None, merged: bool) -> ExportPlan:
    """Resolve the step (default: the newest) and check that the asked form exists for it."""
    steps = list_steps(job)
    if not steps:
        raise NotFound(f"training job {job.job_id!r} has no published checkpoint yet", param="job_id")
    if step is None:
        step = latest_step(job)
    if step not in steps:
        raise NotFound(f"training job {job.job_id!r} has no checkpoint at step {step} (it has {steps})", param="step")
    manifest = read_manifest(job, step)
    if manifest.kind == "full" and not merged:
        raise InvalidRequest(f"training job {job.job_id!r} trained full weights: it has no adapter to export; "
                             "export it merged", param="merged")  # fmt: skip
    return ExportPlan(job.job_id, step, manifest.kind, merged, job.step_dir(step), Path(manifest.base_model))


def write_export(plan: ExportPlan, dest: Path) -> Path:
    """Write the export into `dest` (created): HF weights that open with `from_pretrained`, or the PEFT adapter."""
    if plan.kind == "lora" and plan.merged:
        if not plan.base_model.is_dir():
            raise NotFound(f"the base model {plan.base_model} of job {plan.job_id!r} is no longer on the server")
        merge_lora(plan.base_model, plan.step_dir, dest)
        # The step's tokenizer files (chat template included) are the ones it trained with.
        for f in plan.step_dir.iterdir():
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy2(f, dest / f.name)
    else:
        copy_files(plan.step_dir, dest, skip=("manifest.json",))
        if plan.kind == "lora":
            _point_adapter_at(dest, plan)
    (dest / EXPORT_MANIFEST).write_text(json.dumps({
        "job_id": plan.job_id, "step": plan.step, "kind": "full" if plan.merged else plan.kind,
        "merged_from_lora": plan.merged and plan.kind == "lora", "base_model": str(plan.base_model),
    }, indent=1) + "\n")  # fmt: skip
    return dest


def _point_adapter_at(dest: Path, plan: ExportPlan) -> None:
    """An exported adapter names its base by the base directory's name (the server's path means nothing outside)."""
    path = dest / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = plan.base_model.name
    path.write_text(json.dumps(config, indent=2) + "\n")


def tar_stream(root: Path, prefix: str) -> Iterator[bytes]:
    """An uncompressed tar of `root`'s files under `prefix/`, yielded in chunks (nothing is held in memory)."""
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        info = tarfile.TarInfo(f"{prefix}/{f.relative_to(root).as_posix()}")
        stat = f.stat()
        info.size, info.mode, info.mtime = stat.st_size, 0o644, int(stat.st_mtime)
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                yield chunk
        if stat.st_size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - stat.st_size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)


def directory_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
