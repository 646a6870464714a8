"""What the Tinker routes do: training clients are RL-session trainers, samplers are published versions, and every
long call is a future the SDK polls.

* A training client (`create_model`) is one session trainer (`server/sessions.py`), its model id the session's
  job id; each primitive is one request file of that session (`{"op": ...}`, `training/tinker_ops.py`), written in
  arrival order (the SDK submits in order), answered in order by the trainer. Being files in the job dir, a model
  id stays valid across a control-plane restart.
* `save_weights_for_sampler` publishes `checkpoints/step-<N>` (hot-swap serves it like any trained model); a
  sampler is (model, version) and samples through the same engine as `/v1/generate` and `/v1/completions`.
* `save_state` / `load_state` are primitives too (`tinker/weights/<name>/` in the run's job dir, see
  `checkpoint/tinker.py`); a client made from saved state is a new session trainer whose first request loads it,
  addressed by the model id the SDK derives itself (`<session>:train:<n>`), kept as an alias of its job id.
* Futures are asyncio tasks kept in memory by request id (`retrieve_future` long-polls one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.session import SessionDir
from scalarlm.checkpoint.tinker import TinkerPath, TinkerRunDir, parse_tinker_path
from scalarlm.protocol.errors import Conflict, InvalidRequest, NotFound, ScalarLMError
from scalarlm.protocol.training import SessionCreateRequest
from scalarlm.server.models import ModelCatalog
from scalarlm.server.routers.tinker import wire
from scalarlm.server.sessions import RLSessions

logger = logging.getLogger(__name__)

# Futures kept after completion, newest last (the SDK may retrieve one more than once on retries).
MAX_FUTURES = 4096
RETRIEVE_WAIT_SECONDS = 20.0
OP_WAIT_SECONDS = 3600.0
# The losses the trainer computes, with the loss_fn_config keys each reads (Tinker's names; numbers only).
SUPPORTED_LOSSES: dict[str, tuple[str, ...]] = {
    "cross_entropy": (), "importance_sampling": (), "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"), "dro": ("beta",)}  # fmt: skip


@dataclass
class Sampler:
    """What a sampling session samples: a model name in the catalog at one version (0: the base)."""

    model: str
    version: int
    base_model: str
    path: str | None = None


class TinkerService:
    """Training clients, samplers and futures of one control plane."""

    def __init__(self, sessions: RLSessions, catalog: ModelCatalog) -> None:
        self.sessions = sessions
        self.catalog = catalog
        self.futures: OrderedDict[str, asyncio.Task[Any]] = OrderedDict()
        self.samplers: dict[str, Sampler] = {}
        self.named: dict[str, Sampler] = {}  # tinker://<model>/sampler_weights/<name> -> sampler
        self.client_sessions: set[str] = set()
        self.aliases: dict[str, str] = {}  # SDK-derived model id -> session job id
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def jobs_dir(self) -> Path:
        return self.catalog.jobs_dir

    def job_id(self, model_id: str) -> str:
        """The session job id a model id names: itself, or the job a client made from saved state runs in."""
        if not isinstance(model_id, str):
            raise InvalidRequest("model_id must be a string", param="model_id")
        if model_id in self.aliases:
            return self.aliases[model_id]
        if ":" in model_id:  # an alias made before a restart of this control plane
            for run_path in self.jobs_dir.glob("*/tinker/run.json"):
                if json.loads(run_path.read_text()).get("alias") == model_id:
                    self.aliases[model_id] = run_path.parent.parent.name
                    return self.aliases[model_id]
            raise NotFound(f"no training client {model_id!r} on this server", param="model_id")
        return model_id

    # futures
    def future(self, work: Awaitable[Any], model_id: str | None = None, samples: int = 0) -> dict[str, Any]:
        """Start `work`; the SDK's UntypedAPIFuture naming it (a sample's names its `samples` sequences too)."""
        request_id = f"req-{uuid.uuid4().hex}"
        self.futures[request_id] = asyncio.ensure_future(work)
        while len(self.futures) > MAX_FUTURES:
            _, old = self.futures.popitem(last=False)
            old.cancel()
        future: dict[str, Any] = {"request_id": request_id, "model_id": model_id}
        if samples:
            future["sample_sequence_ids"] = [f"{request_id}-{i}" for i in range(samples)]
        return future

    def failed(self, error: ScalarLMError, model_id: str | None = None) -> dict[str, Any]:
        """A future that fails with `error`: for a 409, which the SDK would retry forever if answered at once."""

        async def fail() -> None:
            raise error

        return self.future(fail(), model_id)

    async def retrieve(self, request_id: str) -> dict[str, Any] | bytes:
        """The future's result (JSON or protobuf bytes), `try_again` while it runs, or its error."""
        task = self.futures.get(request_id)
        if task is None:
            raise NotFound(f"no future {request_id!r} on this server", param="request_id")
        await asyncio.wait({task}, timeout=RETRIEVE_WAIT_SECONDS)
        if not task.done():
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if task.cancelled():
            return {"error": f"request {request_id} was cancelled", "category": "user"}
        error = task.exception()
        if isinstance(error, ScalarLMError):
            return {"error": error.message, "category": "user" if error.status_code < 500 else "server"}
        if error is not None:
            logger.error("tinker future %s failed: %r", request_id, error)
            return {"error": f"{type(error).__name__}: {error}", "category": "server"}
        return task.result()

    def cancel(self, request_id: str) -> None:
        task = self.futures.get(request_id)
        if task is not None:
            task.cancel()

    # training clients
    def create_model(self, base_model: str, lora: dict[str, Any] | None, metadata: dict[str, Any] | None,
                     owner: str, alias: str | None = None) -> str:  # fmt: skip
        """Launch a session trainer: LoRA of `lora["rank"]`, or full weights (our extension) with rank 0 or
        user_metadata {"adapter_type": "full"}; record the run in its `tinker/run.json`."""
        base = self.catalog.resolve(base_model)
        if base != self.catalog.base:
            raise InvalidRequest(f"base_model {base_model!r}: training starts from the base model "
                                 f"{self.catalog.base!r}", param="base_model")  # fmt: skip
        args = self._train_args(lora, metadata)
        created = self.sessions.create(SessionCreateRequest(train_args=args, max_staleness=1_000_000))
        job = JobDir.under(self.jobs_dir, created.session_id)
        TinkerRunDir(job).write_run({"lora": lora if args["adapter_type"] == "lora" else None, "train_args": args,
                                     "user_metadata": metadata, "owner": owner, "created": time.time(),
                                     "alias": alias})  # fmt: skip
        if alias is not None:
            self.aliases[alias] = created.session_id
        logger.info("tinker model %s: %s", created.session_id, args)
        return created.session_id

    @staticmethod
    def _train_args(lora: dict[str, Any] | None, metadata: dict[str, Any] | None) -> dict[str, Any]:
        full = (metadata or {}).get("adapter_type") == "full" or not lora or int(lora.get("rank", 0)) == 0
        # Open-ended, as every session (RLSessions.create); every published step kept: sampler weights name them.
        args: dict[str, Any] = {"adapter_type": "full", "max_checkpoints_to_keep": None}
        if not full:
            assert lora is not None
            targets = []
            if lora.get("train_attn", True):
                targets += ["q_proj", "k_proj", "v_proj", "o_proj"]
            if lora.get("train_mlp", True):
                targets += ["gate_proj", "up_proj", "down_proj"]
            if not targets:
                raise InvalidRequest("LoRA on the unembedding alone is not supported: set train_attn or train_mlp",
                                     param="lora_config")  # fmt: skip
            rank = int(lora["rank"])
            # Tinker's LoRA scale is independent of rank (alpha = rank keeps ours at 1 x B A).
            args.update(adapter_type="lora", lora_config={"r": rank, "alpha": float(rank), "target_modules": targets})
            if lora.get("seed") is not None:
                args["seed"] = int(lora["seed"])
        return args

    def info(self, model_id: str) -> dict[str, Any]:
        """get_info: the tokenizer is the base model's (a local directory or hub id the client can load)."""
        _, config = self.sessions.session(self.job_id(model_id))
        args = config.train_args
        lora = args.adapter_type == "lora"
        return {"type": "get_info", "model_id": model_id, "model_name": self.catalog.base, "is_lora": lora,
                "lora_rank": args.lora_config.r if lora else None,
                "model_data": {"arch": None, "model_name": self.catalog.base,
                               "tokenizer_id": str(config.base_model)}}  # fmt: skip

    async def op(self, model_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """Queue one primitive on the model's trainer now (in arrival order); the task waits for its answer."""
        model_id = self.job_id(model_id)
        job, _ = await asyncio.to_thread(self.sessions.session, model_id)
        files = SessionDir(job)
        async with self._locks.setdefault(model_id, asyncio.Lock()):
            k = files.next_request_index()
            await asyncio.to_thread(files.write_request, k, [request])
        return {"k": k}

    async def answer(self, model_id: str, k: int) -> dict[str, Any]:
        """Request k's result metrics (its error raised as InvalidRequest)."""
        response = await self.sessions.result(self.job_id(model_id), k, OP_WAIT_SECONDS)
        if response is None:
            raise InvalidRequest(f"model {model_id}: request {k} did not finish in {OP_WAIT_SECONDS:g} s")
        return response.metrics

    async def forward_backward(self, request: dict[str, Any]) -> dict[str, Any]:
        model_id, loss_fn = request["model_id"], request["loss_fn"]
        if loss_fn not in SUPPORTED_LOSSES:
            raise InvalidRequest(f"loss_fn {loss_fn!r} is not supported here; supported: "
                                 f"{', '.join(SUPPORTED_LOSSES)}", param="loss_fn")  # fmt: skip
        for key, value in (request["loss_fn_config"] or {}).items():
            known = SUPPORTED_LOSSES[loss_fn]
            if key not in known:
                raise InvalidRequest(f"loss_fn_config key {key!r} is not read by {loss_fn!r}; it reads "
                                     f"{', '.join(known) or 'none'}", param="loss_fn_config")  # fmt: skip
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequest(f"loss_fn_config[{key!r}] must be a finite number, not {value!r}",
                                     param="loss_fn_config")  # fmt: skip
        if not request["data"]:
            raise InvalidRequest("forward_backward needs at least one datum", param="data")
        op = "forward" if request["forward_only"] else "forward_backward"
        queued = await self.op(model_id, {"op": op, "loss_fn": loss_fn, "loss_fn_config": request["loss_fn_config"],
                                          "data": request["data"]})  # fmt: skip

        async def work() -> bytes:
            metrics = await self.answer(model_id, queued["k"])
            return wire.encode_forward_backward_output(metrics["outputs"], metrics["metrics"])

        return self.future(work(), model_id)

    async def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, Any]:
        for name, value in adam.items():
            if name != "type" and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise InvalidRequest(f"adam_params.{name} must be a finite number", param="adam_params")
        queued = await self.op(model_id, {"op": "optim_step", "adam_params": adam})

        async def work() -> dict[str, Any]:
            metrics = await self.answer(model_id, queued["k"])
            return {"type": "optim_step", "metrics": {k: float(v) for k, v in metrics["metrics"].items()}}

        return self.future(work(), model_id)

    async def save_for_sampler(self, model_id: str, name: str | None) -> dict[str, Any]:
        model_id = self.job_id(model_id)
        if name is not None:
            path = self._new_path(model_id, "sampler_weights", name)
        queued = await self.op(model_id, {"op": "save_weights_for_sampler"})

        async def work() -> dict[str, Any]:
            metrics = await self.answer(model_id, queued["k"])
            version = int(metrics["version"])
            if version > 0:
                await asyncio.to_thread(self.catalog.published, model_id, version)
            sampler = Sampler(model=model_id if version > 0 else self.catalog.base, version=version,
                              base_model=self.catalog.base)  # fmt: skip
            if name is not None:
                sampler.path = str(path)
                self.named[sampler.path] = sampler
                job = await asyncio.to_thread(self.sessions.jobs.job, model_id)
                await asyncio.to_thread(TinkerRunDir(job).write_sampler, name, version)
                return {"type": "save_weights_for_sampler", "path": sampler.path}
            return {"type": "save_weights_for_sampler", "sampling_session_id": self.add_sampler(sampler)}

        return self.future(work(), model_id)

    # samplers
    def add_sampler(self, sampler: Sampler) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
        self.samplers[sampler_id] = sampler
        return sampler_id

    def create_sampling_session(self, base_model: str | None, model_path: str | None) -> str:
        if model_path:
            sampler = self.named.get(model_path) or self._saved_sampler(model_path)
            return self.add_sampler(Sampler(sampler.model, sampler.version, sampler.base_model, model_path))
        base = self.catalog.resolve(base_model)
        return self.add_sampler(Sampler(base, self.catalog.version_of(base), self.catalog.base))

    def sampler(self, request: dict[str, Any]) -> Sampler:
        """The sampler a sample request names (by session id, path or base model)."""
        if request.get("sampling_session_id"):
            sampler = self.samplers.get(request["sampling_session_id"])
            if sampler is None:
                raise NotFound(f"no sampling session {request['sampling_session_id']!r}", param="sampling_session_id")
            return sampler
        return self.samplers[self.create_sampling_session(request.get("base_model"), request.get("model_path"))]

    def _saved_sampler(self, model_path: str) -> Sampler:
        """A named sampler recorded in its run's `tinker/sampler_weights/` (made before a restart)."""
        path = self.parse_path(model_path, "model_path")
        entry = None
        if path.kind == "sampler_weights":
            entry = TinkerRunDir(self.sessions.jobs.job(path.run)).read_sampler(path.name)
        if entry is None:
            raise NotFound(f"no sampler weights at {model_path!r} on this server (save_weights_for_sampler "
                           "with a name makes one)", param="model_path")  # fmt: skip
        version = int(entry["version"])
        return Sampler(path.run if version > 0 else self.catalog.base, version, self.catalog.base, model_path)

    # saved state
    def parse_path(self, path: Any, param: str = "path") -> TinkerPath:
        """A tinker path of this server (its run named by job id or alias); NotFound for an unknown run."""
        try:
            parsed = parse_tinker_path(path)
        except ValueError as e:
            raise InvalidRequest(str(e), param=param) from e
        run = self.job_id(parsed.run)
        self.sessions.jobs.job(run)  # NotFound when the run does not exist
        return TinkerPath(run, parsed.kind, parsed.name)

    def _new_path(self, job_id: str, kind: str, name: Any) -> TinkerPath:
        if not isinstance(name, str):
            raise InvalidRequest("the checkpoint name must be a string", param="path")
        try:
            return parse_tinker_path(f"tinker://{job_id}/{kind}/{name}")
        except ValueError as e:
            raise InvalidRequest(str(e), param="path") from e

    def saved_state(self, path: Any) -> tuple[TinkerPath, Path, dict[str, Any]]:
        """The saved state a `tinker://<run>/weights/<name>` names: path, directory, manifest."""
        parsed = self.parse_path(path)
        if parsed.kind != "weights":
            raise InvalidRequest(f"{path!r} names sampler weights; load_state takes a path that save_state "
                                 "returned (tinker://<run>/weights/<name>)", param="path")  # fmt: skip
        files = TinkerRunDir(self.sessions.jobs.job(parsed.run))
        manifest = files.read_weights_manifest(parsed.name)
        if manifest is None:
            raise NotFound(f"no saved state at {path!r} (save_state makes one)", param="path")
        return parsed, files.weights_dir(parsed.name), manifest

    async def save_state(self, model_id: str, name: Any, overwrite: bool,
                         user_metadata: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
        """save_state(name): the trainable weights and optimizer state as tinker://<run>/weights/<name>."""
        job_id = self.job_id(model_id)
        path = self._new_path(job_id, "weights", name)
        files = TinkerRunDir(await asyncio.to_thread(self.sessions.jobs.job, job_id))
        if files.weights_dir(path.name).exists() and not overwrite:
            return self.failed(Conflict(f"{path} already exists; choose another name or pass overwrite=True",
                                        param="path"), model_id)  # fmt: skip
        queued = await self.op(job_id, {"op": "save_state", "name": path.name, "overwrite": overwrite,
                                        "user_metadata": user_metadata})  # fmt: skip

        async def work() -> dict[str, Any]:
            await self.answer(job_id, queued["k"])
            return {"type": "save_weights", "path": str(path)}

        return self.future(work(), model_id)

    def _relative(self, source: Path) -> str:
        """A saved state's directory relative to `jobs/` (each role resolves it against its own mount)."""
        return str(source.relative_to(self.jobs_dir))

    def _check_fits(self, manifest: dict[str, Any], job_id: str, path: str) -> None:
        """Refuse at submission a saved state of another adapter type or LoRA shape than the model's."""
        _, config = self.sessions.session(job_id)
        args = config.train_args
        if manifest["kind"] != args.adapter_type:
            raise InvalidRequest(f"{path} holds {manifest['kind']} weights; this training client trains "
                                 f"{args.adapter_type} weights", param="path")  # fmt: skip
        if args.adapter_type == "lora":
            saved, ours = manifest["lora_config"], args.lora_config.model_dump()
            if (saved["r"], sorted(saved["target_modules"])) != (ours["r"], sorted(ours["target_modules"])):
                raise InvalidRequest(f"{path} holds LoRA rank {saved['r']} on {saved['target_modules']}; this "
                                     f"training client has rank {ours['r']} on {ours['target_modules']}",
                                     param="path")  # fmt: skip

    async def load_state(self, model_id: str, path: Any, optimizer: bool) -> dict[str, Any]:
        """load_state[_with_optimizer] into an existing training client (its next request)."""
        job_id = self.job_id(model_id)
        parsed, source, manifest = await asyncio.to_thread(self.saved_state, path)
        await asyncio.to_thread(self._check_fits, manifest, job_id, str(parsed))
        queued = await self.op(job_id, {"op": "load_state", "source": self._relative(source), "path": str(parsed),
                                        "optimizer": bool(optimizer)})  # fmt: skip

        async def work() -> dict[str, Any]:
            await self.answer(job_id, queued["k"])
            return {"type": "load_weights", "path": str(path), "model_id": model_id}

        return self.future(work(), model_id)

    async def create_from_state(self, alias: str, path: Any, optimizer: bool, base_model: str | None,
                                user_metadata: dict[str, Any] | None, owner: str) -> dict[str, Any]:  # fmt: skip
        """create_training_client_from_state[_with_optimizer]: a new trainer of the saved run's shape whose first
        request loads the state; addressed by the SDK's own model id for it (`alias`)."""
        if alias in self.aliases:
            return self.failed(Conflict(f"training client {alias!r} already exists", param="model_seq_id"), alias)
        parsed, source, manifest = await asyncio.to_thread(self.saved_state, path)
        run = TinkerRunDir(await asyncio.to_thread(self.sessions.jobs.job, parsed.run)).read_run()
        metadata = dict(user_metadata or run.get("user_metadata") or {})
        if manifest["kind"] == "full":
            metadata["adapter_type"] = "full"
        lora = run.get("lora") or {"rank": (manifest.get("lora_config") or {}).get("r", 0)}
        job_id = await asyncio.to_thread(self.create_model, base_model or self.catalog.base, lora, metadata, owner,
                                         alias)  # fmt: skip
        queued = await self.op(job_id, {"op": "load_state", "source": self._relative(source), "path": str(parsed),
                                        "optimizer": bool(optimizer)})  # fmt: skip

        async def work() -> dict[str, Any]:
            await self.answer(job_id, queued["k"])
            return {"type": "load_weights", "path": str(path), "model_id": alias}

        return self.future(work(), alias)
