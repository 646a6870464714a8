"""Tinker's REST protocol under `/api/v1/` (what the `tinker` SDK 0.38 calls), so its training and sampling clients,
and loops written for them, run against `scalarlm serve` with only the base URL and key changed.

Auth: the SDK sends its API key in `X-API-Key` (keys start with `tml-` on the client side); it is one of our API
keys, checked like a bearer key: scope `train` for training routes, `generate` for sampling. This server does not
turn on the SDK's JWT exchange (`pjwt_auth_enabled` false in the client config), so `/auth/token` is never called.
The routes that do the work are in service.py (training clients = session trainers, futures) and sampling.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from scalarlm.protocol.errors import Forbidden, InvalidRequest, Unauthorized
from scalarlm.server.auth import KeyRing
from scalarlm.server.deps import get_backend, get_state
from scalarlm.server.limits import check_job_limit, count_job
from scalarlm.server.routers.tinker import runs, wire
from scalarlm.server.routers.tinker.sampling import sample
from scalarlm.server.routers.tinker.service import TinkerService

SAMPLING_ROUTES = ("/api/v1/asample", "/api/v1/create_sampling_session", "/api/v1/samplers/")


async def require_tinker_key(request: Request) -> None:
    """The SDK's `X-API-Key` (or a bearer key) must be one of ours, holding `train` (or `generate` to sample)."""
    ring: KeyRing = request.app.state.keys
    request.state.api_key = None
    if not ring.enabled:
        return
    token = request.headers.get("x-api-key", "").strip()
    if not token:
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        token = bearer.strip() if scheme.lower() == "bearer" else ""
    if not token:
        raise Unauthorized("missing API key: the tinker SDK sends it as X-API-Key (api_key= or TINKER_API_KEY)",
                           param="x-api-key")  # fmt: skip
    key = ring.find(token)
    if key is None:
        raise Unauthorized("invalid API key", param="x-api-key")
    scope = "generate" if request.url.path.startswith(SAMPLING_ROUTES) else "train"
    if not key.allows(scope):
        raise Forbidden(f"this API key lacks the {scope!r} scope", param="x-api-key")
    request.state.api_key = key


router = APIRouter(prefix="/api/v1", tags=["tinker"], dependencies=[Depends(require_tinker_key)])
open_router = APIRouter(prefix="/api/v1", tags=["tinker"])


def service(request: Request) -> TinkerService:
    """The app's Tinker service (made on first use, over the app's RL sessions and model catalog)."""
    app_state = request.app.state
    if getattr(app_state, "tinker", None) is None:
        app_state.tinker = TinkerService(app_state.sessions, get_state(request).catalog)
    return app_state.tinker


Tinker = Annotated[TinkerService, Depends(service)]


async def body_of(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise InvalidRequest(f"request body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


Body = Annotated[dict[str, Any], Depends(body_of)]


def _need(body: dict[str, Any], name: str) -> Any:
    if body.get(name) in (None, ""):
        raise InvalidRequest(f"missing field {name!r}", param=name)
    return body[name]


@open_router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request) -> dict[str, Any]:
    state = get_state(request)
    length = state.prompts.max_model_len if state.prompts is not None else state.settings.engine.max_model_len
    return {"supported_models": [{"model_name": state.settings.base_model_name, "max_context_length": length,
                                  "trainable": True, "sampleable": True}]}  # fmt: skip


@router.post("/client/config")
async def client_config() -> dict[str, Any]:
    """Feature flags: API keys as they are (no JWT exchange), JSON/proto bodies uncompressed, chunks in order."""
    return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": False,
            "use_pyqwest_transport": False, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
            "sample_join_sampling_session": False}  # fmt: skip


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
async def telemetry() -> dict[str, str]:
    return {"status": "accepted"}


@router.post("/create_session")
async def create_session(tinker: Tinker) -> dict[str, Any]:
    session_id = f"tinker-{uuid.uuid4().hex[:16]}"
    tinker.client_sessions.add(session_id)
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat")
async def session_heartbeat() -> dict[str, str]:
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, tinker: Tinker) -> Response:
    """A ServiceClient closed; its trainers end on their own idle limit (their weights stay servable)."""
    tinker.client_sessions.discard(session_id)
    return Response(status_code=204)


def owner(request: Request) -> str:
    """Who a training run belongs to in listings: the key's printable id (`local` with auth off)."""
    key = getattr(request.state, "api_key", None)
    return key.key_id if key is not None else "local"


def viewer(request: Request) -> str | None:
    """Whose runs the RestClient routes show: the caller key's own; None (all) to an admin key or with auth off."""
    key = getattr(request.state, "api_key", None)
    return None if key is None or "admin" in key.scopes else key.key_id


async def mine(request: Request, tinker: TinkerService, model_id: Any) -> None:
    """The run a training route or a sampler path names must be the caller key's (NotFound otherwise)."""
    await asyncio.to_thread(runs.check_owner, tinker, model_id, viewer(request))


@router.post("/create_model")
async def create_model(request: Request, body: Body, tinker: Tinker) -> dict[str, Any]:
    check_job_limit(request, tinker.sessions.jobs.is_running)  # a training client is a trainer: max_jobs counts it
    model_id = tinker.create_model(_need(body, "base_model"), body.get("lora_config"), body.get("user_metadata"),
                                   owner(request))  # fmt: skip
    count_job(request, model_id)

    async def created() -> dict[str, Any]:
        return {"type": "create_model", "model_id": model_id}

    return tinker.future(created(), model_id)


@router.post("/get_info")
async def get_info(request: Request, body: Body, tinker: Tinker) -> dict[str, Any]:
    await mine(request, tinker, _need(body, "model_id"))
    return tinker.info(body["model_id"])


@router.post("/forward_backward")
async def forward_backward(request: Request, tinker: Tinker) -> dict[str, Any]:
    if request.headers.get("content-encoding"):
        raise InvalidRequest("compressed forward_backward bodies are not accepted (client config says so)")
    decoded = wire.decode_forward_backward(await request.body())
    await mine(request, tinker, decoded["model_id"])
    return await tinker.forward_backward(decoded)


@router.post("/optim_step")
async def optim_step(request: Request, body: Body, tinker: Tinker) -> dict[str, Any]:
    await mine(request, tinker, _need(body, "model_id"))
    adam = body.get("adam_params")
    if adam is None:
        raise InvalidRequest("only Adam is supported: send adam_params", param="optimizer_params")
    return await tinker.optim_step(_need(body, "model_id"), adam)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request, body: Body, tinker: Tinker) -> dict[str, Any]:
    await mine(request, tinker, _need(body, "model_id"))
    return await tinker.save_for_sampler(_need(body, "model_id"), body.get("path"))


@router.post("/save_weights")
async def save_weights(request: Request, body: Body, tinker: Tinker) -> dict[str, Any]:
    """save_state(name): weights + optimizer state as tinker://<model>/weights/<name> (ttl_seconds: kept until
    deleted)."""
    await mine(request, tinker, _need(body, "model_id"))
    return await tinker.save_state(_need(body, "model_id"), _need(body, "path"), bool(body.get("overwrite")),
                                   body.get("user_metadata"))  # fmt: skip


@router.post("/load_weights")
async def load_weights(request: Request, body: Body, tinker: Tinker) -> dict[str, Any]:
    """load_state[_with_optimizer] into a training client (model_id), or a new client from saved state
    (session_id + model_seq_id: the SDK's create_training_client_from_state[_with_optimizer])."""
    path, optimizer = _need(body, "path"), bool(body.get("optimizer"))
    await mine(request, tinker, path)
    if body.get("weights_access_token"):
        raise InvalidRequest("weights_access_token is not supported: every run of this server is readable with a "
                             "key that holds the train scope", param="weights_access_token")  # fmt: skip
    if body.get("model_id"):
        await mine(request, tinker, body["model_id"])
        return await tinker.load_state(body["model_id"], path, optimizer)
    if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
        raise InvalidRequest("only Adam (optimizer_config type 'adamw') is supported", param="optimizer_config")
    alias = f"{_need(body, 'session_id')}:train:{_need(body, 'model_seq_id')}"  # the model id the SDK derives
    check_job_limit(request, tinker.sessions.jobs.is_running)
    future = await tinker.create_from_state(alias, path, optimizer, body.get("base_model"), body.get("user_metadata"),
                                            owner(request))  # fmt: skip
    if alias in tinker.aliases:
        count_job(request, tinker.aliases[alias])
    return future


@router.post("/weights_info")
async def weights_info(request: Request, body: Body, tinker: Tinker) -> dict[str, Any]:
    return await asyncio.to_thread(runs.weights_info, tinker, _need(body, "tinker_path"), viewer(request))


@router.get("/training_runs")
async def training_runs(request: Request, tinker: Tinker, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    return await asyncio.to_thread(runs.list_training_runs, tinker, limit, offset, viewer(request))


@router.get("/training_runs/{run_id}")
async def training_run(request: Request, run_id: str, tinker: Tinker) -> dict[str, Any]:
    return await asyncio.to_thread(runs.get_training_run, tinker, run_id, viewer(request))


@router.get("/training_runs/{run_id}/checkpoints")
async def run_checkpoints(request: Request, run_id: str, tinker: Tinker) -> dict[str, Any]:
    return await asyncio.to_thread(runs.list_checkpoints, tinker, run_id, viewer(request))


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(request: Request, run_id: str, checkpoint_id: str, tinker: Tinker) -> Response:
    await asyncio.to_thread(runs.delete_checkpoint, tinker, run_id, checkpoint_id, viewer(request))
    return Response(status_code=204)


@router.get("/checkpoints")
async def checkpoints(request: Request, tinker: Tinker, limit: int = 100, offset: int = 0) -> dict[str, Any]:
    return await asyncio.to_thread(runs.list_user_checkpoints, tinker, limit, offset, viewer(request))


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request, body: Body, tinker: Tinker) -> dict[str, Any]:
    if body.get("model_path"):
        await mine(request, tinker, body["model_path"])
    sampler_id = tinker.create_sampling_session(body.get("base_model"), body.get("model_path"))
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, tinker: Tinker) -> dict[str, Any]:
    sampler = tinker.sampler({"sampling_session_id": sampler_id})
    return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.path}


@router.post("/asample")
async def asample(request: Request, body: Body, tinker: Tinker) -> dict[str, Any]:
    if body.get("model_path") and not body.get("sampling_session_id"):
        await mine(request, tinker, body["model_path"])
    sampler = tinker.sampler(body)
    backend = get_backend(request)
    samples = int(body.get("num_samples") or 1)
    return tinker.future(sample(backend, get_state(request).catalog, sampler, body), samples=samples)


@router.post("/retrieve_future")
async def retrieve_future(body: Body, tinker: Tinker) -> Response:
    result = await tinker.retrieve(_need(body, "request_id"))
    if isinstance(result, bytes):
        return Response(result, media_type=wire.PROTO_MEDIA_TYPE)
    return JSONResponse(result)


@router.post("/cancel_future")
async def cancel_future(body: Body, tinker: Tinker) -> dict[str, Any]:
    for request_id in body.get("request_ids") or [body.get("request_id")]:
        if request_id:
            tinker.cancel(request_id)
    return {"cancelled": True, "time": time.time()}
