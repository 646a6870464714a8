"""Read and write Hugging Face checkpoint directories (safetensors weights, config.json, tokenizer files).

Reading is lazy: `Weights` maps tensor names to their files (from `model.safetensors.index.json` when the
checkpoint is sharded, else from each file's header) and reads a tensor, or only some rows or columns of it, when
asked (`safe_open(...).get_slice`), counting what it read. A TP rank thus reads only its slices (shard_load.py) and
no rank holds a full fp32 copy of the model. bf16, fp16 and fp32 sources are read as stored and cast per tensor.

Writing keeps the source's tensor dtypes (unless asked otherwise) and shards files beyond `max_shard_bytes` with an
index, as `save_pretrained` does; it also writes `config.json`, `generation_config.json` and the tokenizer files.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from scalarlm.checkpoint.jobdir import link_or_copy
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.families.layouts import view_entry
from scalarlm.training.families.spec import entry_view, unstacked

INDEX_NAME = "model.safetensors.index.json"
# Files of a base model that are weights or weight indexes: never copied into a published checkpoint.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
_SKIP_NAMES = {"config.json", "manifest.json", INDEX_NAME, "pytorch_model.bin.index.json"}
_MAX_COPIED_FILE = 64 * 1024 * 1024
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # fmt: skip
PUBLISH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(model_dir: Path) -> dict[str, Any]:
    """The model's `config.json` as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise InvalidRequest(f"base model {model_dir} has no config.json (expected a local HF model directory)")
    return json.loads(path.read_text())


def _file_map(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index of a sharded checkpoint, else every header)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"base model {model_dir} has no *.safetensors weights")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            out.update({name: f for name in sf.keys()})
    return out


class Weights(Mapping[str, Tensor]):
    """A checkpoint's tensors, read lazily: `weights[name]` reads one whole tensor, `read_ranges` only some rows
    (or columns); each is cast to `dtype` (None: as stored). `bytes_read` / `reads` count what was read."""

    def __init__(self, model_dir: Path, dtype: torch.dtype | None = torch.float32) -> None:
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.files = _file_map(self.model_dir)
        self._open: dict[Path, Any] = {}
        self.bytes_read = 0
        self.reads: list[tuple[str, tuple[int, ...]]] = []
        self._last_entry: tuple[tuple[str, int] | None, Tensor | None] = (None, None)  # the stacked entry read last

    def _handle(self, name: str) -> Any:
        try:
            path = self.files[name]
        except KeyError:
            raise KeyError(name) from None
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def __getitem__(self, name: str) -> Tensor:
        return self.read_ranges(name, 0, None)

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read the tensor; an entry of a stacked tensor (`spec.stacked`) is in when it is
        return isinstance(name, str) and unstacked(name)[0] in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape (header only; of the one entry for a stacked tensor's entry)."""
        tensor, index = unstacked(name)
        shape = tuple(self._handle(tensor).get_slice(tensor).get_shape())
        if index is None:
            return shape
        return tuple(view_entry(torch.empty(shape[1:], device="meta"), entry_view(name)).shape)

    def source_dtype(self, name: str) -> torch.dtype:
        """The stored dtype (header only)."""
        tensor, _ = unstacked(name)
        return _DTYPES[self._handle(tensor).get_slice(tensor).get_dtype()]

    def read_ranges(self, name: str, axis: int, ranges: Sequence[tuple[int, int]] | None) -> Tensor:
        """Rows (`axis` 0) or columns (`axis` 1) `ranges` of a tensor, concatenated; None: the whole tensor. For an
        entry of a stacked tensor (`spec.stacked`) the rows and columns are the entry's: only it is read (the whole
        entry when the name takes a view of it, `spec.VIEWS`, whose rows and columns are then the view's)."""
        tensor, index = unstacked(name)
        handle = self._handle(tensor)
        piece = handle.get_slice(tensor)
        at: tuple[int, ...] = () if index is None else (index,)
        read = 0  # bytes read beyond what is returned (a view's whole entry, when not read just before)
        if view := entry_view(name):
            if self._last_entry[0] != (tensor, index):  # a rule reads an entry's views one after another
                self._last_entry = ((tensor, index), piece[index])
                read = self._last_entry[1].numel() * self._last_entry[1].element_size()
            seen = view_entry(self._last_entry[1], view)
            parts = [seen] if ranges is None else [seen.narrow(axis, a, b - a) for a, b in ranges]
            read -= sum(p.numel() * p.element_size() for p in parts)
        elif index is None and ranges is None:
            parts = [handle.get_tensor(tensor)]
        elif ranges is None:
            parts = [piece[index]]
        elif axis == 0:
            parts = [piece[(*at, slice(a, b))] for a, b in ranges]
        elif axis == 1:
            parts = [piece[(*at, slice(None), slice(a, b))] for a, b in ranges]
        else:
            raise ValueError(f"axis must be 0 or 1, got {axis}")
        out = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)).contiguous()
        self.bytes_read += read + out.numel() * out.element_size()
        self.reads.append((name, tuple(out.shape)))
        return out if self.dtype is None else out.to(self.dtype)

    def iter_tensors(self, names: Iterable[str]) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) for each name, read one at a time."""
        for name in names:
            yield name, self[name]

    def stored_bytes(self) -> int:
        """Bytes of every tensor as stored (what reading the whole checkpoint would cost)."""
        total = 0
        for name in self.files:
            numel = 1
            for n in self.shape(name):
                numel *= n
            total += numel * torch.empty((), dtype=self.source_dtype(name)).element_size()
        return total

    def close(self) -> None:
        """Release the open files."""
        self._open.clear()
        self._last_entry = (None, None)

    def __enter__(self) -> "Weights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensor_names(model_dir: Path) -> set[str]:
    """Names of every tensor in the model's safetensors files (index or headers only)."""
    return set(_file_map(model_dir))


def source_dtypes(model_dir: Path) -> dict[str, torch.dtype]:
    """Each tensor's stored dtype (headers only)."""
    with Weights(model_dir) as weights:
        return {name: weights.source_dtype(name) for name in weights}


def load_weights(model_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Every tensor of the model's safetensors files, cast to `dtype` (reads the whole model: tests and tools)."""
    with Weights(model_dir, dtype) as weights:
        return dict(weights.iter_tensors(list(weights)))


def copy_support_files(base_dir: Path, dest: Path) -> None:
    """Hard-link (else copy) tokenizer, generation config and chat template files (not weights, not config.json).

    Linking keeps every publish cheap (sessions publish after each step); the files are never written in place.
    Files of a hub cache snapshot are symlinks into its blobs: the link goes to the blob.
    """
    for f in Path(base_dir).iterdir():
        if (
            f.is_file()
            and f.name not in _SKIP_NAMES
            and not f.name.endswith(_WEIGHT_SUFFIXES)
            and f.stat().st_size <= _MAX_COPIED_FILE
        ):
            link_or_copy(f, dest / f.name)


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """A minimal generation_config.json (what `save_pretrained` derives) for a base model that has none."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


def cast_for_publish(
    state: Mapping[str, Tensor], dtypes: Mapping[str, torch.dtype] | torch.dtype | None
) -> dict[str, Tensor]:
    """Tensors in the dtypes to publish: per name (the source's), one for all, or as trained (None)."""
    out = {}
    for name, t in state.items():
        want = dtypes.get(name) if isinstance(dtypes, Mapping) else dtypes
        out[name] = (t.to(want) if want is not None and t.is_floating_point() else t).contiguous()
    return out


def save_safetensors(dest: Path, state: Mapping[str, Tensor], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write `model.safetensors`, or `model-0000k-of-0000n.safetensors` + the index beyond `max_shard_bytes`."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(dest / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        save_file(shard, str(dest / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    write_index(dest, weight_map, sum(t.numel() * t.element_size() for t in state.values()))
    return files


def write_index(dest: Path, weight_map: Mapping[str, str], total_bytes: int) -> None:
    """`model.safetensors.index.json`: which file holds each tensor, and the tensors' total size."""
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def config_in_dtype(config: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """`config` saying its weights are stored in `dtype` (under `torch_dtype` where it has that older key)."""
    out = dict(config)
    out["torch_dtype" if "torch_dtype" in out else "dtype"] = str(dtype).removeprefix("torch.")
    return out


def write_checkpoint(
    dest: Path,
    state: dict[str, Tensor],
    base_dir: Path,
    config: dict[str, Any],
    dtypes: Mapping[str, torch.dtype] | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write an HF checkpoint: safetensors (HF names, in `dtypes`), config.json, generation_config.json and the base
    model's tokenizer files and chat template."""
    state = cast_for_publish(state, dtypes)
    floating = Counter(t.dtype for t in state.values() if t.is_floating_point())
    dtype = floating.most_common(1)[0][0] if floating else next(iter(state.values())).dtype
    config = config_in_dtype(config, dtype)
    save_safetensors(dest, state, max_shard_bytes)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    copy_support_files(base_dir, dest)
    if not (dest / "generation_config.json").exists():
        (dest / "generation_config.json").write_text(json.dumps(_generation_config(config), indent=2) + "\n")
